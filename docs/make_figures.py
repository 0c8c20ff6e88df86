"""Draw docs/img/search.png: one EffOPD search on a 2-parameter quadratic, with the real
``ExtrapolatingOptimizer`` (plain SGD inside, gate = minus the loss). Run from the repo root:
``python docs/make_figures.py``."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lookahead_opd import ExtrapolatingOptimizer  # noqa: E402

H = torch.tensor([[1.0, 0.0], [0.0, 12.0]])  # an ill-conditioned valley
OPT = torch.tensor([3.0, 0.0])


def loss(w: torch.Tensor) -> torch.Tensor:
    d = w - OPT
    return 0.5 * d @ H @ d


def main(out: str = "docs/img/search.png") -> None:
    w = torch.nn.Parameter(torch.tensor([-3.0, 1.2]))
    points = [w.detach().clone()]
    opt = ExtrapolatingOptimizer(torch.optim.SGD([w], lr=0.02), lambda: -float(loss(w.detach())))
    for _ in range(8):
        opt.zero_grad()
        loss(w).backward()
        opt.step()
        points.append(w.detach().clone())
    rec = opt.history[-1]  # the search after step 8; its anchor is what the step-4 search left
    anchor, final = points[4], points[-1]
    c_kept = rec.accepted or 0.0
    w_t = (final + c_kept * anchor) / (1 + c_kept)  # final = W_t + c·(W_t − anchor)
    delta = w_t - anchor
    cands = torch.stack([w_t + c * delta for c in rec.coefficients])
    everything = torch.cat([torch.stack(points), cands, OPT[None]])
    lo, hi = everything.min(0).values - 0.4, everything.max(0).values + 0.4
    xs = torch.linspace(lo[0].item(), hi[0].item(), 200)
    ys = torch.linspace(lo[1].item(), hi[1].item(), 200)
    gx, gy = torch.meshgrid(xs, ys, indexing="xy")
    z = 0.5 * ((gx - OPT[0]) ** 2 * H[0, 0] + (gy - OPT[1]) ** 2 * H[1, 1])
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ax.contour(gx, gy, z, levels=24, colors="0.8", linewidths=0.7)
    path = torch.stack(points)
    ax.plot(path[:, 0], path[:, 1], ".-", color="tab:blue", label="weights after each step (kept jumps included)")
    ax.plot(*w_t.tolist(), "s", color="tab:blue", ms=6)
    ax.text(w_t[0].item(), w_t[1].item() - 0.25, "W_8", ha="center", fontsize=8)
    ax.text(anchor[0].item(), anchor[1].item() - 0.25, "anchor", ha="center", fontsize=8)
    ax.annotate("", xy=w_t.tolist(), xytext=anchor.tolist(),
                arrowprops=dict(arrowstyle="->", color="black"))
    ax.text(*(anchor + 0.5 * delta + torch.tensor([0.0, 0.08])).tolist(), "Δ", ha="center")
    for c in rec.coefficients:
        p = w_t + c * delta
        ok = rec.accepted is not None and c <= rec.accepted
        ax.plot(*p.tolist(), "o" if ok else "x", color="tab:green" if ok else "tab:red", ms=8)
        ax.text(p[0].item(), p[1].item() + 0.1, f"c={c:g}\n{'better' if ok else 'not better: stop'}",
                ha="center", fontsize=7)
    ax.plot(*OPT.tolist(), "*", color="black", ms=10, label="optimum")
    ax.set_title(f"the search after step 8: W + c·Δ for c = 1, 2, 4, …, kept while the gate improves "
                 f"(kept c = {rec.accepted})", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
