"""See what the agent learned: structured dumps of sampled episodes, and one static HTML page per
run that shows them with the learning curves.

    python report.py runs/default                    # (re)build runs/default/report.html
    python -m webbrowser -t runs/default/report.html  # open it: no server, no network

train.py calls `dump_step` at its dump steps (rank 0, the episodes of its samples_step*.txt): it
writes episodes_step<step>.jsonl beside the text dump and rebuilds report.html. eval_swebench.py
writes one record per instance beside each trajectory text (`write_episode`) and a page for the
evaluation (`write_eval_report`); ablations.py one page comparing its variants
(`write_ablation_report`). Every page is report_template.html with the data inlined as JSON: it
opens from the file system and loads nothing.

One record (a JSONL line) per episode: its outcome, and per window (k = 0, 1, …) the token ids,
the text of each token (`token_pieces`), the spans (kind, start, end) over the response, the loss
mask (1 on the tokens the policy sampled) and the sampler's log-probs. A window that was in the
update's batch also has, per response token, what the update used: `in_loss` (the mask the loss
weighed: summaries are 0 under --summaries masked), `trainer_logprobs` (log π_old, the trainer's
recompute), `values` (V before the token), `advantages` (Â as trained), `returns` (G, the critic's
target) and `a_loc` (eq. 13's local GAE of the window alone, what estimator N trains on); and per
window λ, N_after and eq. 14's factor (γλ)^N_after, so that estimator P's Â = factor · A_loc can be
set beside N's A_loc on the same episode.
"""
import glob
import json
import math
import os
import re
import sys

import torch

from advantage import correction_factor, segment_gae
from metrics import read_records as read_metrics_records
from rollout import Episode, Segment

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "report_template.html")
MAX_DUMPS = 12  # dump steps shown on a page (evenly spread, first and last kept); the JSONL keeps all
MAX_EVAL_EPISODES = 24  # episodes per (K, run) on an evaluation's page
CURVES = (("rollout/reward", "reward"), ("rollout/success_given_compaction", "success given compaction"),
          ("rollout/compactions", "compactions per rollout"), ("policy/entropy", "entropy"),
          ("policy/approx_kl", "KL(π_old ‖ π_θ)"), ("value/explained_variance", "explained variance"))
PER_TOKEN = ("in_loss", "trainer_logprobs", "values", "advantages", "returns", "a_loc")


# --- the dump -----------------------------------------------------------------------------------

def token_pieces(decode, ids):
    """The text of each token of `ids`: slices of decode(ids) that join to it exactly. A token that
    ends inside a character (byte-level BPE) gets "" and the one that completes it the character.
    Each token is decoded with the tokens since the last clean boundary, so the cost is linear."""
    text = decode(ids)
    pieces, given, start, at = [], 0, 0, 0  # given: chars handed out; (start, at): where the chunk began
    for i in range(len(ids)):
        chunk = decode(ids[start:i + 1])
        if chunk.endswith("\ufffd") or not text.startswith(chunk, at):
            pieces.append("")
            continue
        at = at + len(chunk)
        pieces.append(text[given:at])
        given, start = at, i + 1
    if pieces:
        pieces[-1] += text[given:]
    return pieces


def summary_location(pieces, summary):
    """[first, end) of the tokens of `pieces` whose text holds `summary` (where a resumed window
    reads back the summary the previous one wrote), or None when it is not there."""
    if not summary:
        return None
    text = "".join(pieces)
    at = text.find(summary)
    if at < 0:
        return None
    ends = [0]
    for p in pieces:
        ends.append(ends[-1] + len(p))
    first = next(i for i in range(len(pieces)) if ends[i + 1] > at)
    end = next(i for i in range(len(pieces)) if ends[i + 1] >= at + len(summary)) + 1
    return [first, end]


def _num(x, digits=6):
    """A float for JSON: `digits` significant digits; null for NaN or ±inf (strict JSON has neither)."""
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def _nums(t):
    return [_num(x) for x in t.tolist()]


def episode_record(ep, decode, rows=None, gamma=1.0, step=None):
    """The record of one Episode (module docstring). rows: {segment_index: training row} of this
    episode as the update used it (train.py: old_logprobs, old_values, advantages, returns,
    lambda, n_after; batch.to_rows' mask), None when it was not in the batch (an evaluation, or an
    episode left out). gamma: γ of the update."""
    windows = []
    for k, seg in enumerate(ep.segments):
        prompt = token_pieces(decode, seg.prompt_ids)
        w = {"index": k, "prompt_ids": list(seg.prompt_ids), "prompt_pieces": prompt,
             "summary_read": summary_location(prompt, ep.summaries[k - 1]) if 0 < k <= len(ep.summaries) else None,
             "response_ids": list(seg.response_ids), "response_pieces": [], "spans": [list(s) for s in seg.spans],
             "loss_mask": list(seg.loss_mask), "sampler_logprobs": [_num(x) for x in seg.logprobs]}
        for _, a, b in seg.spans:  # per span, so each span's text is exactly its decode (the text dump's)
            w["response_pieces"] += token_pieces(decode, seg.response_ids[a:b])
        row = (rows or {}).get(seg.segment_index)
        if row is not None:
            w.update(_trainer_fields(row, len(seg.prompt_ids), gamma))
        windows.append(w)
    return {"step": step, "rollout_id": ep.rollout_id, "task_id": ep.task_id, "group_id": ep.group_id,
            "reward": _num(ep.reward), "end_reason": ep.end_reason, "turns": ep.turns,
            "compactions": ep.compactions, "summaries": list(ep.summaries), "gamma": gamma,
            "in_batch": rows is not None and len(rows) == len(ep.segments), "windows": windows}


def _trainer_fields(row, n_prompt, gamma):
    """What the update used for one window, per response token: the row's target positions from
    n_prompt − 1 on (position t predicts token t + 1)."""
    mask = row["mask"].double()
    lam = row["lambda"]
    a_loc, _ = segment_gae((row["old_values"].double() * mask)[None], mask[None],
                           torch.tensor([float(row["reward"])], dtype=torch.float64), gamma, lam)  # eq. (13)
    per_token = {"in_loss": mask, "trainer_logprobs": row["old_logprobs"], "values": row["old_values"],
                 "advantages": row["advantages"], "returns": row["returns"], "a_loc": a_loc[0]}
    out = {k: _nums(v[n_prompt - 1:]) for k, v in per_token.items()}
    out["in_loss"] = [int(x) for x in out["in_loss"]]
    factor = correction_factor(torch.tensor([row["n_after"]]), gamma, lam)  # eq. (14)
    return {**out, "lambda": _num(lam), "n_after": int(row["n_after"]), "correction": _num(factor[0])}


def episode_from_record(rec):
    """The rollout.Episode a record was made from (ids, spans, masks, sampler log-probs, outcome)."""
    ep = Episode(rec["rollout_id"], rec["task_id"], rec["group_id"], reward=math.nan if rec["reward"] is None
                 else rec["reward"], turns=rec["turns"], compactions=rec["compactions"],
                 end_reason=rec["end_reason"], summaries=list(rec["summaries"]))
    for w in rec["windows"]:
        ep.segments.append(Segment(w["prompt_ids"], w["response_ids"], w["loss_mask"], w["sampler_logprobs"],
                                   [tuple(s) for s in w["spans"]], rec["rollout_id"], w["index"], ep.reward))
    return ep


def dump_step(out_dir, step, episodes, rows, decode, gamma):
    """train.py, rank 0, at a dump step: out_dir/episodes_step<step>.jsonl with the records of
    `episodes` (the ones of samples_step<step>.txt), their windows' data from `rows` (theirs in the
    batch, after advantages, from whichever rank trained on them: train.rows_of), then report.html
    rebuilt."""
    by_episode = {}
    for r in rows:
        by_episode.setdefault(r["rollout_id"], {})[r["segment_index"]] = r
    path = os.path.join(out_dir, f"episodes_step{step:05d}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for ep in episodes:
            f.write(json.dumps(episode_record(ep, decode, by_episode.get(ep.rollout_id), gamma, step),
                               allow_nan=False) + "\n")
    write_run_report(out_dir)


def write_episode(path, ep, decode):
    """eval_swebench.py: the record of one evaluated episode (no trainer data), as one JSON line."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(episode_record(ep, decode), allow_nan=False) + "\n")


def read_records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def dump_paths(run_dir):
    """{step: path} of a training run's episodes_step*.jsonl, by step."""
    paths = glob.glob(os.path.join(run_dir, "episodes_step*.jsonl"))
    return dict(sorted((int(re.search(r"episodes_step(\d+)\.jsonl$", p).group(1)), p) for p in paths))


# --- the pages ----------------------------------------------------------------------------------

def spread(items, n):
    """At most n of `items`, evenly spread, the first and the last kept."""
    if len(items) <= n or n < 2:
        return list(items)[:n]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def run_data(run_dir, name, max_dumps=MAX_DUMPS):
    """What a page holds of one training run: its curves (metrics.jsonl), config and dumps."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = read_metrics_records(path) if os.path.exists(path) else []
    curves = {key: [[r["step"], r.get(key)] for r in records if key in r] for key, _ in CURVES}
    cfg_path = os.path.join(run_dir, "config.json")
    config = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    paths = dump_paths(run_dir)
    shown = spread(list(paths), max_dumps)  # only these files are read
    return {"name": name, "curves": curves, "config": config,
            "dumps": [{"label": f"step {s}", "episodes": read_records(paths[s])} for s in shown]}


CONFIG_SHOWN = ("task", "estimator", "gamma", "lam_mode", "lam_alpha", "lam", "whiten_advantages", "summaries",
                "normalizer", "context_budget", "reserve", "max_compactions", "rollouts_per_step", "steps",
                "seed", "model")


def write_page(path, data):
    """report_template.html with `data` inlined; written beside, then renamed, so a reader never
    sees half a page."""
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    payload = json.dumps(data, allow_nan=False, ensure_ascii=False).replace("</", "<\\/")  # no early </script>
    html = template.replace("/*REPORT_DATA*/null", payload)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(html)
    os.replace(path + ".tmp", path)
    return path


def read_page(path):
    """The data a page holds: what write_page inlined."""
    with open(path, encoding="utf-8") as f:
        html = f.read()
    start = html.index('<script id="report-data" type="application/json">')
    body = html[html.index(">", start) + 1:html.index("</script>", start)]
    return json.loads(body)


def write_run_report(run_dir):
    """run_dir/report.html of a training run: curves, config and the episodes it dumped."""
    run = run_data(run_dir, os.path.basename(os.path.normpath(run_dir)))
    return write_page(os.path.join(run_dir, "report.html"), {
        "title": f"CompactionRL run {run['name']}", "kind": "train", "curve_keys": [list(c) for c in CURVES],
        "config_keys": list(CONFIG_SHOWN), "runs": [run], "panels": [], "table": ""})


def write_ablation_report(root, run_dirs, panels, table_md):
    """root/report.html comparing ablations.py's variants. run_dirs: {variant: [(seed, run dir)]};
    panels: {panel: [variant]}; table_md: the markdown of ablations.table. Curves: every seed;
    episodes: the first seed of each variant."""
    runs = []
    for variant, seeds in run_dirs.items():
        for i, (seed, d) in enumerate(seeds):
            run = run_data(d, f"{variant} · seed {seed}", max_dumps=MAX_DUMPS if i == 0 else 0)
            runs.append({**run, "group": variant, "seed": seed})
    return write_page(os.path.join(root, "report.html"), {
        "title": "CompactionRL ablations", "kind": "ablations", "curve_keys": [list(c) for c in CURVES],
        "config_keys": list(CONFIG_SHOWN), "runs": runs,
        "panels": [{"title": p, "groups": g} for p, g in panels.items()], "table": table_md})


def write_eval_report(out_dir, settings, table_text, max_episodes=MAX_EVAL_EPISODES):
    """out_dir/report.html of an evaluation. settings: {label: run dir with trajectories/*.jsonl};
    the first `max_episodes` instances (by id) of each."""
    runs = []
    for label, d in settings.items():
        paths = sorted(glob.glob(os.path.join(d, "trajectories", "*.jsonl")))[:max_episodes]
        runs.append({"name": label, "curves": {}, "config": {},
                     "dumps": [{"label": "instances", "episodes": [r for p in paths for r in read_records(p)]}]})
    return write_page(os.path.join(out_dir, "report.html"), {
        "title": "CompactionRL evaluation", "kind": "eval", "curve_keys": [], "config_keys": [], "runs": runs,
        "panels": [], "table": table_text})


if __name__ == "__main__":
    for d in sys.argv[1:] or ["runs/default"]:
        print(write_run_report(d))
