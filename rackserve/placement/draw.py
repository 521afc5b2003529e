"""A plan as a PNG: racks side by side, each tray a row of GPU cells coloured by instance.

A cell shows its instance's number in the plan (the legend lists number and name); afd expert
GPUs are hatched; "KV" marks a tray with a KV store; a free GPU is grey in a partly used tray, else white.
matplotlib is imported here only (the optional `plot` extra).
"""

from __future__ import annotations

import math
from pathlib import Path

from rackserve.placement.planner import GpuId, Plan

_RACKS_PER_ROW = 8
_LEGEND_MAX = 40  # more instances than this: the legend lists the first ones


def draw(plan: Plan, path: str | Path) -> Path:
    """Write the drawing of `plan` to `path` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    topo = plan.topology
    owner = {g: (k, inst, g in inst.expert_gpus) for k, inst in enumerate(plan.instances) for g in inst.all_gpus}
    colour = [plt.get_cmap("tab20")(k % 20) for k in range(len(plan.instances))]
    kv = {(k.rack, k.tray) for k in plan.kv_stores}
    stranded = plan.stranded_per_rack()
    width = max(t.num_gpus for r in topo.racks for t in r.trays) + 3  # + tray names and the KV mark
    height = max(len(r.trays) for r in topo.racks) + 2  # + rack title
    cols = min(len(topo.racks), _RACKS_PER_ROW)
    rows = math.ceil(len(topo.racks) / cols)
    fig, ax = plt.subplots(figsize=(1.9 + 0.42 * width * cols, 0.6 + 0.3 * height * rows))
    for n, rack in enumerate(topo.racks):
        x0, y0 = (n % cols) * width + 2, -(n // cols) * height
        ax.text(x0, y0 + 0.3, f"{rack.name} ({stranded[rack.name]} stranded)", fontsize=8, weight="bold")
        for t, tray in enumerate(rack.trays):
            y = y0 - 1 - t
            ax.text(x0 - 0.15, y + 0.5, tray.name, fontsize=5, ha="right", va="center")
            if (rack.name, tray.name) in kv:
                ax.text(x0 + tray.num_gpus + 0.15, y + 0.5, "KV", fontsize=5, va="center", color="purple")
            gpus = [GpuId(rack.name, tray.name, g) for g in range(tray.num_gpus)]
            used = sum(gpu in owner for gpu in gpus)
            for g, gpu in enumerate(gpus):
                k, inst, expert = owner.get(gpu, (None, None, False))
                face = colour[k] if inst else ("0.8" if 0 < used < tray.num_gpus else "white")
                ax.add_patch(Rectangle((x0 + g, y), 1, 1, facecolor=face, edgecolor="0.6", lw=0.3,
                                       hatch="///" if expert else None))
                if inst:
                    ax.text(x0 + g + 0.5, y + 0.5, str(k), fontsize=4.5,
                            ha="center", va="center")
            ax.add_patch(Rectangle((x0, y), tray.num_gpus, 1, fill=False, edgecolor="black", lw=0.8))
    handles = [Patch(facecolor=colour[k], label=f"{k}: {inst.name}")
               for k, inst in enumerate(plan.instances[:_LEGEND_MAX])]
    if len(plan.instances) > _LEGEND_MAX:
        handles.append(Patch(facecolor="white", label=f"... {len(plan.instances) - _LEGEND_MAX} more"))
    handles.append(Patch(facecolor="0.8", label="free in a used tray"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=6, frameon=False)
    ax.set_xlim(0, cols * width)
    ax.set_ylim(-rows * height + 1, 1)
    ax.set_aspect("equal")
    ax.axis("off")
    summary = plan.summary()
    ax.set_title(f"{topo.name}: {summary['racks_used']} racks used, {summary['gpus_used']}/"
                 f"{summary['gpus_total']} GPUs, {summary['stranded_gpus']} stranded", fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path

