"""What every environment speaks: the agent's action format and the types a step returns.

Scaffold (mini-swe-agent's text style): each turn the policy writes its reasoning and exactly ONE
fenced shell block; it runs as `bash -c <command>` in a fresh subshell of a sandbox (sandbox.py:
`cd` and variables do not persist); the observation is the exit code and the merged output; the
agent submits by running a command whose first output line is `SUBMIT_SENTINEL`. The submission
is the sentinel alone: the patch is taken from the sandbox with git, never from the model's text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# One `bash -c` argument may hold at most 128 KiB (Linux's MAX_ARG_STRLEN); a longer command could
# not even start, so it is the agent's format error, not a sandbox failure.
MAX_COMMAND_BYTES = 100_000


@dataclass
class Step:
    """What every environment's `step(action_text)` returns."""
    observation: str
    done: bool
    format_error: bool = False


@dataclass
class CommandResult:
    output: str        # stdout and stderr merged, capped (see `truncated`)
    returncode: int    # negative: killed by that signal (subprocess convention)
    timed_out: bool
    truncated: bool


# A fence opens on a line that is ``` and an optional info word, and closes on the next line that is
# exactly ``` (trailing blanks allowed): matching every language pairs fences correctly, so the
# closing fence of a ```python block is never taken for an opening one. Command blocks are bash, sh
# and plain ones.
OPENING_FENCE = re.compile(r"```([\w+-]*)[ \t]*")
CLOSING_FENCE = re.compile(r"```[ \t]*")
COMMAND_LANGUAGES = ("bash", "sh", "")
FORMAT_HELP = ("Reply with your reasoning followed by exactly ONE shell command block, like this:\n\n"
               "```bash\n<command>\n```\n\n"
               f"When you are done, submit by running `echo {SUBMIT_SENTINEL}` as a command of its own.")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info word, body) of every closed fenced block, in one pass over the lines: linear in the
    text's length whatever it holds (a regex over the whole text backtracks quadratically over
    many unclosed fences)."""
    blocks, language, body = [], None, []
    for line in text.split("\n"):
        if language is None:
            if opening := OPENING_FENCE.fullmatch(line):
                language, body = opening.group(1), []
        elif CLOSING_FENCE.fullmatch(line):
            blocks.append((language, "\n".join(body)))
            language = None
        else:
            body.append(line)
    return blocks


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of one turn of a reasoning model (Qwen3, GLM-4.5: `<think>…</think>`
    then the answer). The reasoning runs to the last `</think>`, as the chat templates cut it;
    a turn that opens `<think>` and never closes it (cut at the length cap while reasoning) is all
    reasoning, with no answer. Commands and answers are read from the answer only: a command
    sketched while reasoning is not run."""
    if "</think>" in text:
        reasoning, close, answer = text.rpartition("</think>")
        return reasoning + close, answer
    if "<think>" in text:
        return text, ""
    return "", text


def parse_action(text: str) -> tuple[str | None, str | None]:
    """(command, None), or (None, a message telling the agent the expected format)."""
    blocks = [body for language, body in fenced_blocks(text) if language in COMMAND_LANGUAGES]
    if len(blocks) != 1:
        return None, f"Format error: expected exactly one ```bash block, found {len(blocks)}.\n{FORMAT_HELP}"
    command = blocks[0].strip("\n")
    if not command.strip():
        return None, f"Format error: the command block is empty.\n{FORMAT_HELP}"
    if "\0" in command:
        return None, f"Format error: the command contains a NUL byte, which no shell command can.\n{FORMAT_HELP}"
    if (size := len(command.encode("utf-8", "surrogateescape"))) > MAX_COMMAND_BYTES:
        return None, (f"Format error: the command is {size} bytes long; at most {MAX_COMMAND_BYTES} fit. "
                      f"Write large files in several commands.\n{FORMAT_HELP}")
    return command, None


def is_submission(output: str) -> bool:
    """mini-swe-agent's convention: the output's first line is the sentinel."""
    lines = output.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == SUBMIT_SENTINEL


def format_observation(result: CommandResult) -> str:
    warning = ("<warning>The command did not finish within its time limit and was killed. "
               "Avoid interactive or long-running commands.</warning>\n") if result.timed_out else ""
    return f"<returncode>{result.returncode}</returncode>\n{warning}<output>\n{result.output}</output>"
