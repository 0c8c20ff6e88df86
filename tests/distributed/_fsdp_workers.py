"""Workers for the two-process gloo runs of the OPD loop with ``fsdp=True`` (launched by
``_dist_workers.launch``). They train and record; ``test_fsdp_gloo`` asserts.

The problem is the OPD tests' own: the char tokenizer (21 tokens, so the embedding's 21 rows
shard unevenly), a 2-layer tiny Qwen2 student and a sharper teacher, arithmetic prompts.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from conftest import tiny_qwen2
from torch import nn

from lookahead_opd.integrations.opd.engines import Engine, Rollout, build_rollout, tokenize_prompts


def tokenizer():
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    return char_tokenizer()


def models(tok, rank: int = 0) -> tuple[nn.Module, nn.Module]:
    student = tiny_qwen2(len(tok), 100 + rank, tokenizer=tok)  # the trainer broadcasts rank 0's
    teacher = tiny_qwen2(len(tok), 1, tokenizer=tok)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30.0)
    return student, teacher


class FixedEngine(Engine):
    """Rollouts that do not depend on the weights: each prompt's completion is its last three
    characters reversed, then EOS. One step on these is the same computation however the
    student is laid out, so a sharded step can be compared with a single-process one."""

    def __init__(self, tok) -> None:
        self.tokenizer = tok

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, num_samples: int = 1) -> Rollout:
        rows = [ids for ids in tokenize_prompts(self.tokenizer, prompts) for _ in range(num_samples)]
        done = [p.strip()[-3:][::-1] for p in prompts for _ in range(num_samples)]
        completions = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:max_new_tokens - 1]
                       + [self.tokenizer.eos_token_id] for t in done]
        return build_rollout(rows, completions, [[0.0] * len(c) for c in completions],
                             pad_id=self.tokenizer.pad_token_id, eos_id=self.tokenizer.eos_token_id,
                             tokenizer=self.tokenizer)


def config(out_dir: str | Path, **kw: Any):
    from lookahead_opd.integrations.opd.config import OPDConfig

    base = dict(output_dir=str(out_dir), batch_size=8, max_steps=4, learning_rate=1e-2,
                max_new_tokens=4, eval_every=0, eval_size=6, gate_size=6, progress=False,
                gate="neg_kl", seed=0)
    base.update(kw)
    return OPDConfig(**base)


def trainer(cfg, rank: int, engine: str):
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    tok = tokenizer()
    student, teacher = models(tok, rank)
    eng = FixedEngine(tok) if engine == "fixed" else HFEngine(student, tok, batch_size=2)
    return OPDTrainer(cfg, student, teacher, ArithmeticTask(), eng, tokenizer=tok)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from lookahead_opd.integrations.opd.sharding import gathered_weights

    return {n: t.clone() for n, t in gathered_weights(model)}


def _run(cfg, rank: int, engine: str) -> dict:
    t = trainer(cfg, rank, engine)
    result = t.train()
    from lookahead_opd.integrations.opd.sharding import resident_nbytes

    return {
        "params": full_params(t.student),
        "losses": [m["loss"] for m in result.metrics if "loss" in m],
        "grad_norms": [m["grad_norm"] for m in result.metrics if "grad_norm" in m],
        "evals": result.evals,
        "history": [j.to_dict() for j in getattr(t.optimizer, "history", [])],
        "bytes": resident_nbytes(t.student, t.optimizer),
        "teacher_sharded": type(t.teacher).__name__.startswith("FSDP"),
    }


# One step compared with one process: SGD, so the step is linear in the gradient. (AdamW's
# first step is lr·g/(|g|+eps): for the few weights whose gradient is ~1e-9, a cancellation of
# much larger terms, the other summation order moves the weight by up to ~1e-6.)
ONE_STEP = dict(max_steps=1, optimizer="sgd", learning_rate=0.1)


def opd_worker(rank: int, tmp: str) -> dict:
    """The runs the tests compare: one step on fixed rollouts (sharded); four steps with
    EffOPD through HFEngine, replicated and sharded (with checkpoints at steps 2 and 4); the
    sharded run resumed from its step-2 checkpoint; a sharded teacher and mixed precision."""
    tmp_path = Path(tmp)
    out: dict = {}
    out["one_step"] = _run(config(tmp_path / "one", **ONE_STEP, fsdp=True), rank, "fixed")
    effopd = dict(extrapolate=True, save_every=2)
    out["replicated"] = _run(config(tmp_path / "rep", **effopd), rank, "hf")
    out["sharded"] = _run(config(tmp_path / "fsdp", fsdp=True, **effopd), rank, "hf")
    # Resume from step 2 in a fresh directory holding only that checkpoint.
    resumed = tmp_path / "resumed"
    if rank == 0:
        resumed.mkdir()
        shutil.copytree(tmp_path / "fsdp" / "checkpoint-2", resumed / "checkpoint-2")
        (resumed / "latest").write_text("checkpoint-2\n")
    torch.distributed.barrier()
    out["resumed"] = _run(config(resumed, fsdp=True, resume=True, **effopd), rank, "hf")
    out["sharded_teacher"] = _run(config(tmp_path / "st", **ONE_STEP, fsdp=True,
                                         fsdp_teacher="shard"), rank, "fixed")
    out["bf16"] = _run(config(tmp_path / "bf16", max_steps=2, fsdp=True,
                              fsdp_mixed_precision="bfloat16"), rank, "hf")
    # The chunked loss and -KL gate (the lm_head gathered after the root's forward), with a
    # sharded teacher too.
    out["chunked"] = _run(config(tmp_path / "chunked", **CHUNKED, fsdp=True, loss_chunk_size=3,
                                 fsdp_teacher="shard"), rank, "fixed")
    return out


# One step of the full-vocabulary loss with a gated search (the -KL gate), as ONE_STEP.
CHUNKED = dict(ONE_STEP, loss="reverse_kl", extrapolate=True)


def single_process_run(out_dir: Path, **kw: Any) -> dict:
    """What the tests compare the sharded runs with: the same config in one process."""
    engine = kw.pop("engine", "fixed")
    t = trainer(config(out_dir, **kw), 0, engine)
    result = t.train()
    from lookahead_opd.integrations.opd.sharding import resident_nbytes

    return {"params": {n: p.detach().clone() for n, p in t.student.named_parameters()},
            "losses": [m["loss"] for m in result.metrics if "loss" in m],
            "grad_norms": [m["grad_norm"] for m in result.metrics if "grad_norm" in m],
            "bytes": resident_nbytes(t.student, t.optimizer)}


# ---------------------------------------------------------------------- engines
class _RecordingWorker:
    """Stands in for a vLLM worker: ``reload_weights`` consumes the weights one at a time as
    vLLM's loader does (copying each into its own model, keeping no reference), records what
    it got, and measures how many bytes of the pushed tensors are alive at each receipt."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.peak_alive = 0
        self._alive: list[tuple[weakref.ref, int]] = []

    def get_model(self) -> nn.Module:
        return nn.Module()

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        for name, t in weights_iterator:
            self._alive.append((weakref.ref(t), t.numel() * t.element_size()))
            self.peak_alive = max(self.peak_alive, sum(n for r, n in self._alive if r() is not None))
            self.received[name] = t.clone()
            del t


class _RecordingLLM:
    def __init__(self) -> None:
        self.worker = _RecordingWorker()

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        pass


def recording_vllm_engine(tok):
    """A real ``VLLMEngine`` (its ``push_weights``, ``_push`` and worker function) whose vLLM is
    the recorder above: vLLM cannot run several processes on one CPU machine here."""
    from lookahead_opd.integrations.opd.engines import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.tokenizer, engine.llm = tok, _RecordingLLM()
    engine.enable_sleep_mode, engine.num_pushes, engine.push_seconds = False, 0, 0.0
    engine._source, engine._sleep_level, engine._pending_push = None, None, False
    engine._expected_names = None
    return engine


def engines_worker(rank: int) -> dict:
    """A sharded student pushed to a (recording) colocated vLLM engine, and greedy HFEngine
    rollouts through it with a different number of prompts and batches on each rank."""
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.sharding import decoder_blocks, shard

    tok = tokenizer()
    student = tiny_qwen2(len(tok), 7, tokenizer=tok)
    blocks = [sum(p.numel() * p.element_size() for p in b.parameters())
              for b in decoder_blocks(student)]
    shard(student, train=True)
    engine = recording_vllm_engine(tok)
    engine.push_weights(student)
    worker = engine.llm.worker
    prompts = ["1+2=", "33*3=", "7-5=", "(1+1)*4="][: 1 + 2 * rank]  # 1 on rank 0, 3 on rank 1
    rollout = HFEngine(student, tok, batch_size=1).generate(prompts, max_new_tokens=5,
                                                            temperature=0.0)
    return {"received": worker.received, "peak_alive": worker.peak_alive,
            "block_bytes": blocks, "num_pushes": engine.num_pushes,
            "prompts": prompts, "texts": rollout.texts}
