"""Draws docs/img/segments.png: a small residual net's layer-call graph,
coloured by the segment graphckpt's planner puts each call in.

Run: python docs/make_diagram.py
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from keras import layers  # noqa: E402

from graphckpt.graph.build import build_graph  # noqa: E402
from graphckpt.planner import plan_segments  # noqa: E402


def residual_model():
    inp = keras.Input((16, 16, 3), name="image")
    x = layers.Conv2D(8, 3, padding="same", name="stem")(inp)
    for i in range(3):
        y = layers.Conv2D(8, 3, padding="same", name=f"conv{i}a")(x)
        y = layers.BatchNormalization(name=f"bn{i}")(y)
        y = layers.Conv2D(8, 3, padding="same", name=f"conv{i}b")(y)
        x = layers.Add(name=f"add{i}")([x, y])
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inp, layers.Dense(10, name="head")(x))


def draw(path):
    graph = build_graph(residual_model())
    plan = plan_segments(graph, segments=3)
    colour = {n: s.index for s in plan.segments for n in s.nodes}
    order = [n for n, d in graph.nodes(data=True) if d["kind"] == "input"] + list(plan.order)
    pos = {n: (i, 0.6 if graph.nodes[n]["class_name"] == "Add" else 0) for i, n in enumerate(order)}
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    fig, ax = plt.subplots(figsize=(13, 2.6))
    for u, v in graph.edges:
        crossing = colour.get(u) != colour.get(v)
        ax.annotate(
            "", xy=pos[v], xytext=pos[u],
            arrowprops=dict(arrowstyle="->", color="black" if crossing else "#999999",
                            lw=2.0 if crossing else 1.0, connectionstyle="arc3,rad=-0.25"),
        )
    for n in order:
        c = palette[colour[n] % len(palette)] if n in colour else "#bbbbbb"
        ax.scatter(*pos[n], s=900, color=c, zorder=3)
        ax.text(pos[n][0], pos[n][1] - 0.32, n[0], ha="center", va="top", fontsize=8, rotation=30)
    for s in plan.segments:
        xs = [pos[n][0] for n in s.nodes]
        ax.text(sum(xs) / len(xs), 1.05, f"segment {s.index}", ha="center", fontsize=10,
                color=palette[s.index % len(palette)], weight="bold")
    ax.set_xlim(-0.7, len(order) - 0.3)
    ax.set_ylim(-1.1, 1.3)
    ax.axis("off")
    ax.set_title("Layer calls cut into 3 segments; bold black edges are the tensors kept for backward", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "img", "segments.png"))
