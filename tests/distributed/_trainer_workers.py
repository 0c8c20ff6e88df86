"""Workers for the two-process gloo runs of ``transformers.Trainer`` with the
ExtrapolationCallback (launched by ``_dist_workers.launch``, which joins the processes in a
gloo group first; the environment set here makes Accelerate adopt that group, as it would
under ``torchrun``).

The problem is a tiny Qwen2 learning counting sequences; the Trainer runs DDP over the two
ranks, eight optimizer steps of two micro-batches each, so searches follow steps 1, 2, 4, 8.
"""

from __future__ import annotations

import os

import torch
from conftest import tiny_qwen2
from torch import nn

from lookahead_opd import PAPER_RULE

WORLD_SIZE = 2
VOCAB = 50
SEQ = 8
STEPS = 8
GATE_SIZE = 16
NOISE = 0.05  # rank-dependent offsets on the eval_fn scores


class Counting(torch.utils.data.Dataset):
    """Sequences ``s, s+1, ...`` (mod VOCAB); records which items this process fetched."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model():
    return tiny_qwen2(VOCAB, 0, max_position_embeddings=32)


def slice_loss(model: nn.Module, ids: torch.Tensor) -> float:
    """The LM loss of ``model`` on ``ids`` (eval mode, no grad)."""
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _join_accelerate(rank: int) -> None:
    """What torchrun would have set; the gloo group already exists, Accelerate reuses it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )


def trainer_worker(rank: int, tmp: str) -> dict:
    """Two Trainer runs on this rank: one gated by an ``eval_fn`` on this rank's half of the
    gate set (plus a rank-dependent offset, so the ranks disagree on their own), one gated by
    ``gate_dataset=`` (``trainer.evaluate`` shards the gate set over the ranks)."""
    _join_accelerate(rank)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lookahead_opd.integrations.hf_trainer import ExtrapolationCallback

    def args(name: str) -> TrainingArguments:
        return TrainingArguments(
            output_dir=os.path.join(tmp, name),
            max_steps=STEPS,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=GATE_SIZE // WORLD_SIZE,  # one batch per rank
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            logging_steps=100,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
            ddp_backend="gloo",
        )

    class AfterEveryStep(TrainerCallback):
        """Weights after every optimizer step, before the search (``on_optimizer_step``) and
        after it (``on_step_end``, registered after the ExtrapolationCallback)."""

        def __init__(self, model: nn.Module) -> None:
            self.model = model
            self.stepped: dict[int, dict[str, torch.Tensor]] = {}
            self.ended: dict[int, dict[str, torch.Tensor]] = {}

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.stepped[state.global_step + 1] = _params(self.model)

        def on_step_end(self, args, state, control, **kwargs):
            self.ended[state.global_step] = _params(self.model)

    out: dict = {"world": torch.distributed.get_world_size()}

    # --- eval_fn on this rank's slice, with offsets that make the ranks disagree
    model = make_model()
    train = Counting(64, seed=1)
    gate = Counting(GATE_SIZE, seed=2)
    mine = gate.ids.chunk(WORLD_SIZE)[rank]
    raw: list[float] = []

    def eval_fn() -> float:
        raw.append(-slice_loss(model, mine) + NOISE * (-1.0) ** (rank + len(raw)))
        return raw[-1]

    spy = AfterEveryStep(model)
    trainer = Trainer(model=model, args=args("eval_fn"), train_dataset=train)
    cb = ExtrapolationCallback(eval_fn, **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.add_callback(spy)
    trainer.train()
    out["eval_fn"] = {
        "ddp": type(trainer.model_wrapped).__name__,
        "history": [r.to_dict() for r in cb.history],
        "raw": raw,
        "after": spy.ended,
        "params": _params(model),
    }

    # --- gate_dataset: trainer.evaluate on the gate set, sharded over the ranks
    model = make_model()
    gate = Counting(GATE_SIZE, seed=2)
    spy = AfterEveryStep(model)
    trainer = Trainer(model=model, args=args("gate"), train_dataset=Counting(64, seed=1))
    cb = ExtrapolationCallback(gate_dataset=gate, metric="eval_loss", **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.add_callback(spy)
    trainer.train()
    out["gate_dataset"] = {
        "history": [r.to_dict() for r in cb.history],
        "fetched": gate.fetched,
        "stepped": spy.stepped,
        "after": spy.ended,
        "params": _params(model),
    }
    return out
