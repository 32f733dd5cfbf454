"""report.py: the episode dump round-trips to the text dump and holds what the update used; the
page renders in headless Chromium (Debian's `chromium`, driven over the DevTools pipe by
tests/browser.py) with no console error and no request, and its episode view shows each window
with its spans, trained tokens, summary and credit. The episode view's screenshot is kept at
artifacts/report_episode.png (CI's artifact). Without chromium the page test skips, except where
COMPACTIONRL_TEST_REQUIRE_CHROMIUM=1 (CI), where it fails.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_report.py   (about 30 seconds)
"""
import json
import os
import subprocess
import sys

import pytest

import report
from browser import Chromium
from conftest import require_chromium
from model import load_tokenizer
from rollout import format_episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "artifacts")


def test_token_pieces_join_to_the_text_and_wait_for_whole_characters():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731  a byte-level tokenizer
    ids = list("hé 漢!".encode()) + [0xFF] + list(b"ok")
    pieces = report.token_pieces(decode, ids)
    assert "".join(pieces) == decode(ids) and len(pieces) == len(ids)
    assert pieces == ["h", "", "é", " ", "", "", "漢", "!", "", "\ufffdo", "k"]  # a lone bad byte waits too
    assert report.token_pieces(decode, []) == []


def test_summary_location_covers_the_tokens_that_hold_the_summary():
    pieces = ["Task", ": x", " Summary", ":\nke", "y B", "<|end|>"]
    assert report.summary_location(pieces, "key B") == [3, 5]
    assert report.summary_location(pieces, "Task") == [0, 1]
    assert report.summary_location(pieces, "absent") is None and report.summary_location(pieces, "") is None


def test_a_page_shows_dump_steps_spread_over_the_run_first_and_last_kept():
    steps = list(range(0, 300, 10))
    shown = report.spread(steps, 12)
    assert len(shown) == 12 and shown[0] == 0 and shown[-1] == 290 and shown == sorted(set(shown))
    assert report.spread(steps[:5], 12) == steps[:5] and report.spread(steps, 0) == []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """train.py, 2 steps, every step dumped. Enough warm-up that some episodes succeed, so the
    critic learns nonzero values and the advantages are not all 0."""
    out = str(tmp_path_factory.mktemp("report") / "run")
    args = [sys.executable, "train.py", "--out-dir", out, "--steps", "2", "--dump-every", "1",
            "--rollouts-per-step", "16", "--warmup-steps", "40", "--value-pretrain-steps", "1", "--mini-batches", "2",
            "--no-export-hf"]
    p = subprocess.run(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    return out


def test_the_dump_round_trips_to_the_text_dump(run):
    decode = load_tokenizer(os.path.join(run, "tiny_model")).decode
    for step in (0, 1):
        records = report.read_records(os.path.join(run, f"episodes_step{step:05d}.jsonl"))
        assert len(records) == 3 and all(r["step"] == step for r in records)
        text = "\n\n".join(format_episode(report.episode_from_record(r), decode) for r in records)
        assert text == open(os.path.join(run, f"samples_step{step:05d}.txt")).read()
        for w in (w for r in records for w in r["windows"]):  # what the page shows is that text
            assert "".join(w["prompt_pieces"]) == decode(w["prompt_ids"])
            assert len(w["response_pieces"]) == len(w["response_ids"])
            for _, a, b in w["spans"]:
                assert "".join(w["response_pieces"][a:b]) == decode(w["response_ids"][a:b])
    assert max(r["compactions"] for r in records) >= 1
    # the page written at the last step is the one rebuilt from the run's files
    before = report.read_page(os.path.join(run, "report.html"))
    assert report.read_page(report.write_run_report(run)) == before
    assert [d["label"] for d in before["runs"][0]["dumps"]] == ["step 0", "step 1"]


def test_the_dump_holds_what_the_update_used(run):
    """Step 1 (estimator P, γ = 1, λ from the rollout's length, no whitening): each number of a
    window checked against its definition, from the other numbers of the dump."""
    records = report.read_records(os.path.join(run, "episodes_step00001.jsonl"))
    gamma = 1.0
    nonzero = 0
    for r in records:
        assert r["in_batch"] and r["gamma"] == gamma
        windows = r["windows"]
        total = sum(sum(w["in_loss"]) for w in windows)
        for k, w in enumerate(windows):
            n = len(w["response_ids"])
            assert all(len(w[key]) == n for key in report.PER_TOKEN)
            assert w["in_loss"] == w["loss_mask"]  # summaries trained: the loss weighs every sampled token
            assert w["n_after"] == sum(sum(v["in_loss"]) for v in windows[k + 1:])
            assert w["lambda"] == pytest.approx(1 - 1 / (1.5 * total), rel=1e-5)
            assert w["correction"] == pytest.approx((gamma * w["lambda"]) ** w["n_after"], rel=1e-5)  # eq. 14
            loss = [j for j in range(n) if w["in_loss"][j]]
            for j in range(n):
                if j not in loss:
                    assert w["advantages"][j] == 0 and w["a_loc"][j] == 0
            for j in loss:
                assert abs(w["trainer_logprobs"][j] - w["sampler_logprobs"][j]) < 1e-4
                assert w["advantages"][j] == pytest.approx(w["correction"] * w["a_loc"][j], rel=1e-4, abs=1e-6)
                assert w["returns"][j] == pytest.approx(w["a_loc"][j] + w["values"][j], rel=1e-4, abs=1e-6)
                nonzero += abs(w["advantages"][j]) > 1e-4
            # eq. 13 over the window's loss tokens, from its end: δ = R − V at the last one
            nxt = None
            for j in reversed(loss):
                want = r["reward"] - w["values"][j] if nxt is None else \
                    gamma * w["values"][nxt] - w["values"][j] + gamma * w["lambda"] * w["a_loc"][nxt]
                assert w["a_loc"][j] == pytest.approx(want, rel=1e-4, abs=1e-5)
                nxt = j
            if k > 0 and r["summaries"][k - 1]:  # the summary window k − 1 wrote, where window k reads it
                a, b = w["summary_read"]
                assert r["summaries"][k - 1] in "".join(w["prompt_pieces"][a:b])
    assert nonzero > 0


def test_the_page_renders_in_chromium_and_shows_an_episode_window_by_window(run):
    path = require_chromium()
    data = report.read_page(os.path.join(run, "report.html"))
    last = data["runs"][0]["dumps"][-1]["episodes"]
    ep = last[0]  # the most compacted of the step's sample
    assert len(ep["windows"]) >= 2
    with Chromium(path) as browser:
        page = browser.open("file://" + os.path.join(run, "report.html"))
        js = page.evaluate
        assert js("document.querySelectorAll('#curves .chart').length") == len(report.CURVES)
        assert js("document.querySelectorAll('#curves path.series').length") >= len(report.CURVES) - 1
        assert js("document.querySelectorAll('#episodes button').length") == len(last)
        assert js("document.querySelector('#dump').selectedOptions[0].text") == "step 1"
        assert js("document.querySelector('#mode').value") == "P"  # a compacted episode opens on eq. 14's Â
        windows = js("""[...document.querySelectorAll('.window')].map(w => ({
            tokens: w.querySelectorAll('.response .tok').length,
            trained: w.querySelectorAll('.response .tok.trained').length,
            text: w.querySelector('.response').textContent,
            prompt: w.querySelector('.prompt').textContent,
            written: [...w.querySelectorAll('.summary-written')].map(e => e.textContent),
            read: [...w.querySelectorAll('.summary-read')].map(e => e.textContent),
            factor: w.querySelector('.factor').textContent,
            kinds: [...w.querySelectorAll('.response .span')].map(e => e.dataset.kind)}))""")
        assert len(windows) == len(ep["windows"])
        for k, (shown, w) in enumerate(zip(windows, ep["windows"])):
            assert shown["tokens"] == len(w["response_ids"]) and shown["trained"] == sum(w["in_loss"])
            assert shown["text"] == "".join(w["response_pieces"]) and shown["prompt"] == "".join(w["prompt_pieces"])
            assert shown["kinds"] == [s[0] for s in w["spans"]]
            assert float(shown["factor"].split("= ")[1]) == pytest.approx(w["correction"], abs=1e-4)
            summary = [w["response_pieces"][a:b] for kind, a, b in w["spans"] if kind == "summary"]
            assert shown["written"] == ["".join(s) for s in summary]
            if k > 0 and ep["summaries"][k - 1]:
                assert len(shown["read"]) == 1 and ep["summaries"][k - 1] in shown["read"][0]

        def alphas(mode):  # background opacity of window 0's loss tokens under a colour mode
            js(f"document.querySelector('#mode').value = '{mode}'; "
               "document.querySelector('#mode').dispatchEvent(new Event('change'))")
            return js("""[...document.querySelectorAll('.window')[0].querySelectorAll('.tok.trained')].map(t => {
                const m = t.style.backgroundColor.match(/rgba?\\(([^)]*)\\)/);
                return m ? +(m[1].split(',')[3] ?? 1) : 0; })""")
        p, n = alphas("P"), alphas("N")  # one scale for both: P is N shrunk by the window's factor
        factor = ep["windows"][0]["correction"]
        assert factor < 1 and any(a > 0.01 for a in n)
        assert p == pytest.approx([min(1, a * factor) for a in n], abs=5e-3)  # CSS keeps alpha in 1/255ths
        alphas("P")
        js("document.querySelector('.window .tok.trained')"
           ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        info = js("document.querySelector('#tokinfo').textContent")
        assert "window 0 · token" in info and "in the loss" in info and "Â " in info and "P " in info
        js("document.querySelector('#browser').scrollIntoView()")
        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = os.path.join(ARTIFACTS, "report_episode.png")
        page.screenshot(shot)
        assert page.problems() == []
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(shot) > 20_000


def test_the_page_is_one_file_whose_data_cannot_close_its_script(tmp_path):
    with open(report.TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    assert template.count("/*REPORT_DATA*/null") == 1
    for needle in ("http://", "https://", "<link", " src="):  # nothing to load (SVG's namespace is a name)
        assert needle not in template.replace("http://www.w3.org/2000/svg", ""), needle
    data = {"title": "x", "kind": "train", "curve_keys": [], "config_keys": [], "panels": [], "table": "",
            "runs": [{"name": "</script><script>alert(1)</script>", "curves": {}, "config": {}, "dumps": []}]}
    path = report.write_page(str(tmp_path / "page.html"), data)
    html = open(path, encoding="utf-8").read()
    assert html.count("</script>") == template.count("</script>") and report.read_page(path) == data
