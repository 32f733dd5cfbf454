"""The trainer's policy update and scoring pass against a raw baseline on the same rows: how close
to a plain forward and backward the update runs, and how much padding it computes.

    OMP_NUM_THREADS=1 python bench_update.py                  # short: a few minutes on one thread
    OMP_NUM_THREADS=1 python bench_update.py --full           # every set at its full size
    OMP_NUM_THREADS=1 python bench_update.py --full --sets long --repeats 1 --no-warmup   # one set

For each set of rows (windows), on one process (a world of one, FSDP2 as train.py runs it):
* update: `train.optimize` with `train.policy_loss_fn` over the set's mini-batches
  (`batch.minibatch_indices`, as many as `Config.mini_batches`): micro-batches, the actor's
  log-probs, the PPO loss, backward, gradient clipping, the optimizer step;
* scoring: `train.score`, the old log-probs and values of every row;
* raw: the same tokens, packed without padding into rows of at most `micro_batch_tokens`, through
  an unwrapped model — forward, log_softmax(logits).gather over the whole vocabulary, and for the
  update a loss, backward and an Adam step; for scoring the log-probs and the critic's values.
The repeats interleave update, raw update, scoring and raw scoring, after one untimed round
(first calls allocate); a ratio is the median over repeats of raw time ÷ project time on the same
tokens (tokens/s of the project ÷ tokens/s raw).
Padding: the slots the project's micro-batches compute beyond the windows' tokens, ÷ those tokens.

Row sets: one memory-task RL step's rows (the default Config's 128 rollouts; the actions come from
memory_task.WarmupDemoEngine, which writes them as the policy does after its warm-up, with no
model to sample) on the default tiny model; 384 windows of 20–200 random tokens, half of them
trainable, on the tiny model and on a model of hidden 256, 4 layers and a 32768-token vocabulary;
64 windows of 1–2k tokens, all trainable, on the larger model. Without --full the last two sets
are cut to 48 and 4 windows.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import batch
import fsdp
import memory_task
import train
from config import Config, finalize
from model import PACKED_ATTENTION, ChatCodec, build_tiny_model, load_tokenizer
from rollout import run_episodes


def memory_rows(cfg, model_dir):
    """One RL step's windows of the memory task (module docstring)."""
    codec = ChatCodec(load_tokenizer(model_dir))
    per_rank = finalize(cfg, 1)
    envs, task_ids = train.make_envs(cfg, 0, 0, per_rank)
    demo = memory_task.WarmupDemoEngine(codec, cfg.task.memory_keys, seed=0)
    episodes = run_episodes(demo, codec, envs, train.rollout_config(cfg), list(range(len(envs))), task_ids)
    return batch.to_rows([s for e in episodes for s in e.segments], "trained")


def random_rows(n, low, high, vocab, trainable, seed):
    """n windows of low..high random tokens; each target trainable with probability `trainable`;
    4 windows per rollout."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(low, high + 1, (), generator=g))
        mask = (torch.rand(length - 1, generator=g) < trainable).float()
        rows.append({"ids": torch.randint(3, vocab, (length,), generator=g), "mask": mask,
                     "sampler_logprobs": torch.zeros(length - 1), "reward": 1.0, "rollout_id": i // 4,
                     "segment_index": i % 4})
    return rows


def larger_model(out_dir):
    """Hidden 256, 4 layers, 4 heads of 64, a 32768-token vocabulary: a head as costly as the trunk."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32768, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, initializer_range=0.1)
    Qwen3ForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


def with_training_data(rows, seed=0):
    """Advantages and old log-probs as an update sees them (random: only the shapes matter here)."""
    g = torch.Generator().manual_seed(seed)
    for r in rows:
        r["advantages"] = torch.randn(len(r["mask"]), generator=g) * r["mask"]
        r["old_logprobs"] = torch.zeros(len(r["mask"]))
        r["old_values"] = torch.zeros(len(r["mask"]))
    return rows


# --- the raw baseline ------------------------------------------------------------------------------

def raw_models(model_dir):
    from transformers import AutoModel, AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=PACKED_ATTENTION)
    backbone = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=PACKED_ATTENTION)
    return lm.train(), backbone.train(), torch.nn.Linear(lm.config.hidden_size, 1)


def raw_packs(rows, idx, budget):
    """rows[idx] packed in order into rows of at most `budget` tokens (a longer window alone)."""
    packs, cur, n = [], [], 0
    for i in idx:
        if cur and n + len(rows[i]["ids"]) > budget:
            packs.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += len(rows[i]["ids"])
    return packs + ([cur] if cur else [])


def raw_update(lm, opt, rows, minibatches, budget):
    for idx in minibatches:
        z = sum(float(rows[i]["mask"].sum()) for i in idx)
        for pack in raw_packs(rows, idx, budget):
            ids, pos, (mask, adv) = batch.pack([rows[i]["ids"] for i in pack],
                                               [[rows[i][k] for i in pack] for k in ("mask", "advantages")])
            logits = lm(input_ids=ids, position_ids=pos).logits[:, :-1]
            lp = F.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(lp * adv * mask).sum() / z).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@torch.no_grad()
def raw_score(lm, backbone, value_head, rows, budget):
    for pack in raw_packs(rows, range(len(rows)), budget):
        ids, pos, _ = batch.pack([rows[i]["ids"] for i in pack])
        logits = lm(input_ids=ids, position_ids=pos).logits[:, :-1]
        F.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])
        value_head(backbone(input_ids=ids, position_ids=pos).last_hidden_state[:, :-1])


SETS = ("memory", "mixed", "mixed-larger", "long")

# --- the comparison --------------------------------------------------------------------------------

def padding(rows, cfg, device):
    """Slots the project's micro-batches compute beyond the windows' tokens, ÷ those tokens."""
    real = sum(len(r["ids"]) for r in rows)
    slots = sum(b["input_ids"].numel() for mb, b in batch.micro_batches(rows, list(range(len(rows))),
                                                                     cfg.optim.micro_batch_tokens, device) if mb)
    return (slots - real) / real


def compare(name, rows, model_dir, cfg, device, repeats, warmup=True):
    setup = train.memory_setup(cfg, 1, False)
    _, setup, _ = train.check_memory(cfg, model_dir, setup)
    actor, critic = train.make_models(cfg, model_dir, device, save_softmax=setup.save_head)
    opt = train.adam(actor.parameters(), 1e-6)
    lm, backbone, value_head = raw_models(model_dir)
    raw_opt = torch.optim.Adam(lm.parameters(), lr=1e-6, fused=True)
    rows = with_training_data(rows)
    minibatches = batch.minibatch_indices(rows, cfg.optim.mini_batches)
    keys = ("old_logprobs", "advantages")

    def update():
        for idx in minibatches:
            train.optimize(actor, opt, rows, idx, train.policy_loss_fn(cfg), cfg, device, keys)

    def score():
        train.score(actor, critic, [dict(r) for r in rows], cfg, device)

    runs = {"update": update, "raw update": lambda: raw_update(lm, raw_opt, rows, minibatches, cfg.optim.micro_batch_tokens),
            "score": score, "raw score": lambda: raw_score(lm, backbone, value_head, rows, cfg.optim.micro_batch_tokens)}
    for fn in runs.values() if warmup else ():  # first calls allocate and pick kernels
        fn()
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    ratio = {k: statistics.median(raw / mine for raw, mine in zip(times[f"raw {k}"], times[k]))
             for k in ("update", "score")}
    tokens = sum(len(r["ids"]) for r in rows)
    return {"name": name, "windows": len(rows), "tokens": tokens, "update": ratio["update"], "score": ratio["score"],
            "update_tok_s": tokens / statistics.median(times["update"]), "padding": padding(rows, cfg, device)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="every set at its full size (the readings in docs/results.md)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per set")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first round")
    p.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS), help="which row sets to run")
    args = p.parse_args()
    repeats = args.repeats
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers
    transformers.utils.logging.disable_progress_bar()
    _, _, device = fsdp.init_distributed()
    cfg = Config()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(os.path.join(tmp, "tiny"), train.tiny_corpus(), **train.tiny_model_args(cfg))
        larger = larger_model(os.path.join(tmp, "larger"))
        mixed = random_rows(384, 20, 200, 667, 0.5, seed=1)
        few = [dict(r) for r in mixed[:None if args.full else 48]]
        long = 64 if args.full else 4
        sets = {"memory": ("one memory-task RL step, tiny model", lambda: memory_rows(cfg, tiny), tiny),
                "mixed": ("384 windows of 20–200 tokens, tiny model", lambda: mixed, tiny),
                "mixed-larger": (f"{len(few)} of those windows, hidden 256 / 4 layers / 32k vocab", lambda: few, larger),
                "long": (f"{long} windows of 1–2k tokens, all trainable, hidden 256 / 32k vocab",
                         lambda: random_rows(long, 1000, 2000, 32768, 1.0, seed=2), larger)}
        for key in args.sets:
            name, rows, model_dir = sets[key]
            results.append(compare(name, rows(), model_dir, cfg, device, repeats, not args.no_warmup))
            r = results[-1]
            print(f"{name}: update ÷ raw {r['update']:.2f}, scoring ÷ raw {r['score']:.2f}, "
                  f"padding {r['padding']:.2f}", flush=True)
    print(f"\n{repeats} interleaved repeats{'' if args.no_warmup else ' after an untimed one'}, one process, "
          f"{torch.get_num_threads()} thread(s), "
          f"micro_batch_tokens {cfg.optim.micro_batch_tokens}, {cfg.optim.mini_batches} mini-batches\n")
    print("| rows and model | windows | tokens | update ÷ raw, tokens/s (median) | scoring ÷ raw | "
          "padding ÷ real tokens | update tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['name']} | {r['windows']} | {r['tokens']} | {r['update']:.2f} | {r['score']:.2f} | "
              f"{r['padding']:.2f} | {r['update_tok_s']:.0f} |")
    fsdp.close_distributed()


if __name__ == "__main__":
    main()
