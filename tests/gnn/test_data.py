"""Graph files, adapters, named data sets and the synthetic generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from commsched.gnn.graph.data import (
    Graph,
    GraphSource,
    SyntheticSpec,
    clean_edges,
    from_edges,
    from_pyg,
    graph_fingerprint,
    load_dataset,
    load_graph,
    save_graph,
    synthetic_graph,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data not present")


def _good(N: int = 5, S: int | None = None) -> dict[str, np.ndarray]:
    m = lambda k: np.eye(N, dtype=bool)[k] if S is None else np.tile(np.eye(N, dtype=bool)[k], (S, 1))  # noqa: E731
    return {"node_features": np.arange(N * 3, dtype=np.float32).reshape(N, 3),
            "node_labels": np.array([0, 1, 2, 1, 0][:N]),
            "edges": np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 4], [1, 0]]),
            "train_masks": m(0), "val_masks": m(1), "test_masks": m(2)}


def _write(tmp_path: Path, arrays: dict, name: str = "g.npz") -> Path:
    p = tmp_path / name
    np.savez(p, **arrays)
    return p


def test_load_good_file_cleans_edges(tmp_path):
    g = load_graph(_write(tmp_path, _good()))
    assert g.num_nodes == 5 and g.num_features == 3 and g.num_classes == 3
    # self loop 4-4 gone, 0-1 duplicate gone, both directions present, sorted by (target, source)
    assert g.edge_index_2E.t().tolist() == [[1, 0], [0, 1], [2, 1], [1, 2], [3, 2], [2, 3], [4, 3], [3, 4]]
    assert g.train_mask.tolist() == [True, False, False, False, False]
    d = load_graph(_write(tmp_path, _good()), directed=True)
    assert d.edge_index_2E.t().tolist() == [[1, 0], [0, 1], [1, 2], [2, 3], [3, 4]]


def test_split_selection(tmp_path):
    a = _good(S=3)
    a["train_masks"][2] = np.array([0, 0, 0, 0, 1], bool)
    assert load_graph(_write(tmp_path, a), split=2).train_mask.tolist() == [False] * 4 + [True]
    with pytest.raises(ValueError, match=r"key 'train_masks': split 3 asked for but the file holds 3"):
        load_graph(_write(tmp_path, a), split=3)
    with pytest.raises(ValueError, match=r"key 'train_masks': holds one split"):
        load_graph(_write(tmp_path, _good()), split=1)


MALFORMED = [
    # (description, mutate(arrays), key named, message fragment)
    ("missing key", lambda a: a.pop("edges"), "edges", "missing"),
    ("missing mask", lambda a: a.pop("val_masks"), "val_masks", "missing"),
    ("features 1-D", lambda a: a.update(node_features=np.zeros(5, np.float32)), "node_features", "shape"),
    ("features object", lambda a: a.update(node_features=np.array(["a"] * 5)), "node_features", "real numbers"),
    ("features nan", lambda a: a["node_features"].__setitem__((2, 1), np.nan), "node_features", "non-finite"),
    ("features inf", lambda a: a["node_features"].__setitem__((0, 0), np.inf), "node_features", "non-finite"),
    ("no nodes", lambda a: a.update(node_features=np.zeros((0, 3), np.float32)), "node_features", "no nodes"),
    ("labels float", lambda a: a.update(node_labels=np.zeros(5)), "node_labels", "integer"),
    ("labels short", lambda a: a.update(node_labels=np.zeros(4, np.int64)), "node_labels", "shape"),
    ("labels negative", lambda a: a["node_labels"].__setitem__(3, -1), "node_labels", ">= 0"),
    ("label 2^31-1", lambda a: a["node_labels"].__setitem__(3, 2**31 - 1), "node_labels",
     "label 2147483647 at node 3 makes 2147483648 classes (labels 0..2147483647) for 4 distinct labels"),
    ("label 2^40", lambda a: a.update(node_labels=np.array([0, 1, 2, 2**40, 0])), "node_labels", "at node 3"),
    ("labels sparse", lambda a: a["node_labels"].__setitem__(4, 140), "node_labels", "number the classes 0..K-1"),
    ("edges float", lambda a: a.update(edges=a["edges"].astype(float)), "edges", "integer"),
    ("edges [E,3]", lambda a: a.update(edges=np.zeros((4, 3), np.int64)), "edges", "shape"),
    ("edges [2,E]", lambda a: a.update(edges=a["edges"].T.copy()), "edges", "shape"),
    ("edge id too big", lambda a: a["edges"].__setitem__((1, 1), 5), "edges", "range"),
    ("edge id negative", lambda a: a["edges"].__setitem__((0, 0), -1), "edges", "range"),
    ("mask float", lambda a: a.update(train_masks=np.ones(5) * 0.5), "train_masks", "boolean"),
    ("mask int 0/2", lambda a: a.update(test_masks=np.array([0, 2, 0, 0, 0])), "test_masks", "boolean"),
    ("mask wrong N", lambda a: a.update(val_masks=np.zeros(4, bool)), "val_masks", "shape"),
    ("mask [S,N] wrong N", lambda a: a.update(val_masks=np.zeros((2, 4), bool)), "val_masks", "shape"),
    ("mask 3-D", lambda a: a.update(test_masks=np.zeros((1, 1, 5), bool)), "test_masks", "shape"),
]


@pytest.mark.parametrize("desc,mutate,key,frag", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_rejected_with_one_line_naming_key(tmp_path, desc, mutate, key, frag):
    a = _good()
    mutate(a)
    with pytest.raises(ValueError) as ei:
        load_graph(_write(tmp_path, a))
    msg = str(ei.value)
    assert f"key '{key}'" in msg and frag in msg, msg
    assert "\n" not in msg


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_graph(tmp_path / "nope.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_graph(tmp_path / "junk.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single array"):
        load_graph(tmp_path / "single.npy")
    a = _good()
    a["edges"] = np.array([object(), object()], dtype=object)
    np.savez(tmp_path / "obj.npz", **a)
    with pytest.raises(ValueError, match="key 'edges'"):
        load_graph(tmp_path / "obj.npz")


def test_int_masks_accepted_and_save_round_trip(tmp_path):
    a = _good()
    a["train_masks"] = a["train_masks"].astype(np.int8)
    g = load_graph(_write(tmp_path, a))
    save_graph(g, tmp_path / "again.npz")
    h = load_graph(tmp_path / "again.npz")
    assert graph_fingerprint(g) == graph_fingerprint(h)


def test_adapters_agree_with_loader(tmp_path):
    a = _good()
    g = load_graph(_write(tmp_path, a))
    e = from_edges(torch.from_numpy(a["edges"]), a["node_features"], a["node_labels"],
                   a["train_masks"], a["val_masks"], a["test_masks"])
    e2 = from_edges(torch.from_numpy(a["edges"].T.copy()), a["node_features"], a["node_labels"],
                    a["train_masks"], a["val_masks"], a["test_masks"])
    from torch_geometric.data import Data

    d = Data(x=torch.from_numpy(a["node_features"]), y=torch.from_numpy(a["node_labels"]),
             edge_index=torch.from_numpy(a["edges"].T.copy()),
             train_mask=torch.from_numpy(a["train_masks"]), val_mask=torch.from_numpy(a["val_masks"]),
             test_mask=torch.from_numpy(a["test_masks"]))
    p = from_pyg(d)
    for other in (e, e2, p):
        assert graph_fingerprint(other) == graph_fingerprint(g)
    # PyG's [N, S] multi-split masks
    d.train_mask = torch.stack([torch.zeros(5, dtype=torch.bool), torch.ones(5, dtype=torch.bool)], 1)
    assert from_pyg(d, split=1).train_mask.all()
    with pytest.raises(ValueError, match="key 'y'"):
        from_edges(a["edges"], a["node_features"], -np.ones(5, np.int64), a["train_masks"],
                   a["val_masks"], a["test_masks"])
    d.x = None
    with pytest.raises(ValueError, match="key 'x': missing"):
        from_pyg(d)


def test_clean_edges_directed_and_undirected():
    e = np.array([[2, 0], [0, 2], [1, 1], [2, 0], [0, 1]])
    assert clean_edges(e, 3, directed=True).T.tolist() == [[2, 0], [0, 1], [0, 2]]
    assert clean_edges(e, 3, directed=False).T.tolist() == [[1, 0], [2, 0], [0, 1], [0, 2]]


def test_synthetic_is_seeded_structured_and_learnable_shape():
    spec = SyntheticSpec(num_nodes=3000, num_edges=30000, num_features=16, num_classes=5, seed=3,
                         signal=0.5)
    g, h = synthetic_graph(spec), synthetic_graph(spec)
    assert graph_fingerprint(g) == graph_fingerprint(h)
    assert graph_fingerprint(g) != graph_fingerprint(synthetic_graph(SyntheticSpec(
        num_nodes=3000, num_edges=30000, num_features=16, num_classes=5, seed=4)))
    assert g.num_nodes == 3000 and g.num_edges == 60000  # exactly num_edges pairs, both directions
    src, dst = g.edge_index_2E
    assert bool((src != dst).all())
    # community structure: most edges join nodes of the same class
    same = float((g.y_N[src] == g.y_N[dst]).float().mean())
    assert same > 0.7, same
    # skewed degrees: the busiest node has many times the median degree
    deg = torch.bincount(dst, minlength=g.num_nodes).float()
    assert float(deg.max()) > 8 * float(deg.median())
    # class-dependent features: class means differ far more than noise would allow
    means = torch.stack([g.x_NF[g.y_N == k].mean(0) for k in range(5)])
    assert float(torch.cdist(means, means).max()) > 0.3
    masks = torch.stack([g.train_mask, g.val_mask, g.test_mask]).int()
    assert bool((masks.sum(0) == 1).all())


def test_synthetic_spec_errors():
    with pytest.raises(ValueError, match="num_edges"):
        SyntheticSpec(num_nodes=10, num_edges=100)
    with pytest.raises(ValueError, match="homophily"):
        SyntheticSpec(homophily=1.5)
    with pytest.raises(ValueError, match="unknown dataset"):
        GraphSource(kind="dataset", name="reddit", data_root="/x")


@needs_data
def test_named_datasets_load():
    g = load_dataset("cora", DATA)
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (2708, 10556, 1433, 7)
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (140, 500, 1000)
    assert torch.allclose(g.x_NF.sum(1)[g.x_NF.sum(1) > 0], torch.ones(1))  # row-normalised
    m = load_dataset("minesweeper", DATA, split=3)
    assert (m.num_nodes, m.num_edges, m.num_classes) == (10000, 78804, 2)
    with pytest.raises(ValueError, match="not in .*heterophilous"):
        load_dataset("citeseer", DATA / "heterophilous", download=False)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("reddit", DATA)


def test_graph_summary():
    g = Graph(torch.zeros(3, 2), torch.tensor([0, 1, 1]), torch.zeros(2, 0, dtype=torch.long),
              torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool),
              torch.zeros(3, dtype=torch.bool))
    assert g.summary()["num_classes"] == 2 and g.num_edges == 0


def test_from_pyg_says_once_when_it_makes_a_directed_graph_undirected():
    import warnings

    from torch_geometric.data import Data

    N = 6
    ei = torch.tensor([[0, 1, 2, 3, 4, 4], [1, 2, 3, 4, 5, 4]])  # a directed path, one self loop
    m = torch.ones(N, dtype=torch.bool)
    d = Data(x=torch.randn(N, 3), y=torch.zeros(N, dtype=torch.long), edge_index=ei,
             train_mask=m, val_mask=m, test_mask=m)
    with pytest.warns(UserWarning, match=r"edge_index is directed \(5 distinct edges\); made "
                                         r"undirected \(10 edges"):
        g = from_pyg(d, name="path")
    assert g.edge_index_2E.shape[1] == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_pyg(d, directed=True).edge_index_2E.shape[1] == 5  # kept as given
        sym = Data(**{**d.to_dict(), "edge_index": g.edge_index_2E})
        assert from_pyg(sym).edge_index_2E.shape[1] == 10  # already symmetric: nothing said


def test_graph_flags_are_the_synthetic_specs_fields():
    import argparse

    from commsched.configurable import cli_fields
    from commsched.gnn.graph.flags import add_graph_args, graph_args_given, source_from_args

    p = argparse.ArgumentParser()
    add_graph_args(p)
    flags = {o for a in p._actions for o in a.option_strings}
    want = {f.metadata["flag"] or "--syn-" + f.name.replace("_", "-") for f in cli_fields(SyntheticSpec)}
    assert "--syn-degree-exponent" in want and want <= flags and "--syn-train-frac" not in flags
    a = p.parse_args([])
    assert not graph_args_given(a) and source_from_args(a).synthetic == SyntheticSpec()
    a = p.parse_args(["--syn-nodes", "300", "--syn-edges", "900", "--syn-homophily", "0.5"])
    assert graph_args_given(a)
    assert source_from_args(a).synthetic == SyntheticSpec(num_nodes=300, num_edges=900, homophily=0.5)


def test_labels_with_a_few_unused_classes_still_load(tmp_path):
    """Classes absent from a file (a split of a larger label set) are fine up to the slack:
    4 distinct labels, classes 0..139 (10 x 4 + 100 = 140; label 140 is refused above)."""
    a = _good()
    a["node_labels"][4] = 139
    assert load_graph(_write(tmp_path, a)).num_classes == 140
