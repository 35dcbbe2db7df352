"""Partition book on hand-worked graphs, partitioners, and partition folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.gnn.graph.book import build_book, build_books, edge_weights, split_blocks
from commsched.gnn.graph.cli import partition_main as main
from commsched.gnn.graph.data import SyntheticSpec, clean_edges, from_edges, synthetic_graph
from commsched.gnn.graph.partition import (
    edge_cut,
    load_part,
    make_parts,
    partition_nodes,
    read_meta,
    save_partition,
)


def _undirected(pairs, n):
    ei = clean_edges(np.array(pairs), n, directed=False)
    return ei[0], ei[1]


# --------------------------------------------------------------------------- literal graphs
def test_path_graph_two_parts():
    # 0 - 1 | 2 - 3
    src, dst = _undirected([[0, 1], [1, 2], [2, 3]], 4)
    parts = np.array([0, 0, 1, 1])
    b0, b1 = build_books(src, dst, parts, 2)
    assert b0.global_ids.tolist() == [0, 1, 2]            # central 0 | marginal 1 | remote 2
    assert (b0.num_central, b0.num_marginal, b0.num_remote) == (1, 1, 1)
    assert b0.edge_src.tolist() == [1, 0, 2] and b0.edge_dst.tolist() == [0, 1, 1]
    assert b0.in_degree.tolist() == [1, 2, 2]
    assert b0.send_idx.tolist() == [1] and b0.send_counts == (0, 1) and b0.recv_counts == (0, 1)
    assert b1.global_ids.tolist() == [3, 2, 1]            # central 3 | marginal 2 | remote 1
    assert b1.edge_src.tolist() == [1, 0, 2] and b1.edge_dst.tolist() == [0, 1, 1]
    assert b1.send_idx.tolist() == [1] and b1.send_counts == (1, 0)
    # AdaQP weights of the one message each way: node 1 feeds node 2 (degrees 2 and 2)
    assert b0.send_coef_sq["gcn"].tolist() == pytest.approx([1 / 9])
    assert b0.send_coef_sq["mean"].tolist() == pytest.approx([1 / 4])
    assert b0.send_coef_sq["sum"].tolist() == [1.0]       # one edge into rank 1, weight 1
    # GCN weights with self loops, degrees + 1 = [2, 3, 3]
    s, d, w = edge_weights(b0, "gcn")
    got = {(int(a), int(b)): float(x) for a, b, x in zip(s, d, w)}
    assert got == pytest.approx({(0, 0): 1 / 2, (1, 0): 6 ** -0.5, (0, 1): 6 ** -0.5,
                                 (1, 1): 1 / 3, (2, 1): 1 / 3})
    c, m = split_blocks(b0, "mean")
    assert (c.num_dst, c.num_src, m.num_dst, m.num_src) == (1, 2, 1, 3)
    assert c.src.tolist() == [1] and c.w.tolist() == [1.0]
    assert m.src.tolist() == [0, 2] and m.dst.tolist() == [0, 0] and m.w.tolist() == [0.5, 0.5]


def test_directed_graph_sends_a_central_node():
    # 0 -> 2, 3 -> 1, 1 -> 0 ; parts {0,1} {2,3}
    src, dst = np.array([0, 3, 1]), np.array([2, 1, 0])
    b0, b1 = build_books(src, dst, np.array([0, 0, 1, 1]), 2)
    assert b0.global_ids.tolist() == [0, 1, 3] and (b0.num_central, b0.num_marginal) == (1, 1)
    assert b0.send_idx.tolist() == [0]                    # node 0 is central yet needed by part 1
    assert b1.global_ids.tolist() == [3, 2, 0] and (b1.num_central, b1.num_marginal) == (1, 1)
    assert b1.send_idx.tolist() == [0] and b1.send_counts == (1, 0)


def test_star_three_parts_remote_order_and_counts():
    # centre 0 joined to 1..5; parts: 0,5 -> 0; 2,4 -> 1; 1,3 -> 2
    src, dst = _undirected([[0, k] for k in range(1, 6)], 6)
    parts = np.array([0, 2, 1, 2, 1, 0])
    b0, b1, b2 = build_books(src, dst, parts, 3)
    assert b0.global_ids.tolist() == [5, 0, 2, 4, 1, 3]   # remote by (owner, id)
    assert b0.recv_counts == (0, 2, 2) and b0.send_counts == (0, 1, 1)
    assert b0.send_idx.tolist() == [1, 1]                 # node 0 goes to both peers
    assert b0.send_coef_sq["sum"].tolist() == [2.0, 2.0]  # it feeds two nodes of each peer
    assert b0.remote_owner().tolist() == [1, 1, 2, 2]
    assert b0.global_ids[b0.recv_slice(2)].tolist() == [1, 3]
    assert b1.num_central == 0 and b1.global_ids.tolist() == [2, 4, 0]
    assert b1.send_idx.tolist() == [0, 1] and b1.send_counts == (2, 0, 0)
    assert b0.num_central_edges == 1                      # 0 -> 5 into the central node 5


def test_one_part_has_nothing_remote():
    src, dst = _undirected([[0, 1], [1, 2]], 3)
    (b,) = build_books(src, dst, np.zeros(3, np.int64), 1)
    assert b.num_remote == 0 and b.num_marginal == 0 and b.send_idx.size == 0
    assert b.global_ids.tolist() == [0, 1, 2]


def test_book_input_errors():
    src, dst = np.array([0]), np.array([1])
    with pytest.raises(ValueError, match="part ids"):
        build_book(src, dst, np.array([0, 2]), 0, 2)
    with pytest.raises(ValueError, match="endpoints"):
        build_book(src, np.array([5]), np.array([0, 1]), 0, 2)
    with pytest.raises(ValueError, match="rank"):
        build_book(src, dst, np.array([0, 1]), 2, 2)


def _dense(n, src, dst, norm):
    A = np.zeros((n, n))
    A[dst, src] = 1.0                                      # row = target
    deg = A.sum(1)
    if norm == "gcn":
        A = A + np.eye(n)
        dh = (deg + 1) ** -0.5
        return dh[:, None] * A * dh[None, :]
    return A / np.maximum(deg, 1)[:, None]


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 14), st.integers(1, 4), st.integers(0, 10 ** 6), st.booleans())
def test_local_aggregation_equals_global(n, P, seed, directed):
    """Every rank's central + marginal blocks, fed its owned and received rows, reproduce
    the full-graph normalised aggregation of its owned nodes; sends match receives."""
    rng = np.random.default_rng(seed)
    e = rng.integers(0, n, size=(3 * n, 2))
    ei = clean_edges(e, n, directed)
    parts = rng.integers(0, P, n)
    X = rng.standard_normal((n, 3))
    books = build_books(ei[0], ei[1], parts, P)
    for norm in ("gcn", "mean"):
        ref = _dense(n, ei[0], ei[1], norm) @ X
        for b in books:
            c, m = split_blocks(b, norm)
            H = X[b.global_ids]
            out = np.zeros((b.num_owned, 3))
            np.add.at(out, c.dst, c.w[:, None] * H[c.src])
            np.add.at(out, m.dst + b.num_central, m.w[:, None] * H[m.src])
            np.testing.assert_allclose(out, ref[b.owned_ids], atol=1e-12)
    for b in books:
        assert set(b.owned_ids.tolist()) == set(np.flatnonzero(parts == b.rank).tolist())
        for q in range(P):
            sent = b.global_ids[b.send_idx[b.send_slice(q)]]
            got = books[q].global_ids[books[q].recv_slice(b.rank)]
            assert sent.tolist() == got.tolist()
        # central nodes really have no remote in-neighbour
        has_remote = np.zeros(b.num_local, bool)
        has_remote[b.edge_dst[b.edge_src >= b.num_owned]] = True
        assert not has_remote[: b.num_central].any() and has_remote[b.num_central:b.num_owned].all()


# --------------------------------------------------------------------------- partitioners
def _syn(seed=0, n=1500, m=12000):
    return synthetic_graph(SyntheticSpec(num_nodes=n, num_edges=m, num_features=8, num_classes=4,
                                         communities_per_class=2, seed=seed))


def test_partitioners_balanced_deterministic_and_metis_cuts_less():
    g = _syn()
    r = partition_nodes(g, 4, "random", seed=1)
    assert np.bincount(r).tolist() == [375] * 4
    assert np.array_equal(r, partition_nodes(g, 4, "random", seed=1))
    mt = partition_nodes(g, 4, "metis", seed=0)
    assert np.array_equal(mt, partition_nodes(g, 4, "metis", seed=0))
    sizes = np.bincount(mt, minlength=4)
    assert sizes.min() > 0.8 * 375 and sizes.max() < 1.2 * 375
    assert edge_cut(g, mt) < 0.5 * edge_cut(g, r)          # a real cut on a community graph
    assert partition_nodes(g, 1).tolist() == [0] * g.num_nodes
    with pytest.raises(ValueError, match="method"):
        partition_nodes(g, 2, "spectral")
    with pytest.raises(ValueError, match="cannot cut"):
        partition_nodes(from_edges(np.zeros((0, 2), np.int64), np.zeros((2, 1)), np.zeros(2, np.int64),
                                   np.ones(2, bool), np.ones(2, bool), np.ones(2, bool)), 3)


# --------------------------------------------------------------------------- folders
def test_partition_folder_round_trip_and_refusals(tmp_path):
    g = _syn(n=300, m=1500)
    parts = partition_nodes(g, 3, "metis")
    meta = save_partition(tmp_path / "p", g, parts, 3, method="metis", seed=0)
    assert meta["num_parts"] == 3 and meta["edge_cut"] == edge_cut(g, parts)
    assert sorted(f.name for f in (tmp_path / "p").iterdir()) == [
        "meta.json", "part-00000.pt", "part-00001.pt", "part-00002.pt"]
    ref = make_parts(g, parts, 3)
    for r in range(3):
        got = load_part(tmp_path / "p", r, 3, fingerprint=ref[r].fingerprint)
        want = ref[r]
        for k in ("global_ids", "edge_src", "edge_dst", "in_degree", "send_idx"):
            assert np.array_equal(getattr(got.book, k), getattr(want.book, k)), k
        assert got.book.send_counts == want.book.send_counts
        assert got.book.recv_counts == want.book.recv_counts
        assert np.allclose(got.book.send_coef_sq["gcn"], want.book.send_coef_sq["gcn"])
        assert torch.equal(got.x_nF, g.x_NF[torch.from_numpy(want.book.owned_ids)])
        assert torch.equal(got.y_n, want.y_n) and torch.equal(got.test_mask, want.test_mask)
        assert got.totals == want.totals and got.num_classes == 4
    with pytest.raises(ValueError, match="made for 3 parts but this run has world size 2"):
        load_part(tmp_path / "p", 0, 2)
    other = _syn(seed=5, n=300, m=1500)
    from commsched.gnn.graph.data import graph_fingerprint

    with pytest.raises(ValueError, match="made for another graph"):
        load_part(tmp_path / "p", 0, 3, fingerprint=graph_fingerprint(other))
    with pytest.raises(ValueError, match="no meta.json"):
        load_part(tmp_path / "nowhere", 0, 3)
    # a part file from another partition in the same folder is refused
    save_partition(tmp_path / "q", other, partition_nodes(other, 3), 3, method="metis", seed=0)
    (tmp_path / "p" / "part-00001.pt").write_bytes((tmp_path / "q" / "part-00001.pt").read_bytes())
    with pytest.raises(ValueError, match="belongs to another partition"):
        load_part(tmp_path / "p", 1, 3)


def test_partition_cli_writes_folder_and_checks_source(tmp_path, capsys, no_network):
    args = ["--syn-nodes", "400", "--syn-edges", "2000", "--syn-features", "4", "--syn-classes", "3"]
    assert main(args + ["--parts", "2", "--method", "random", "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    assert "random into 2 parts" in out and "part 1:" in out
    meta = read_meta(tmp_path / "f")
    assert meta["graph"]["num_nodes"] == 400 and meta["source_id"].startswith("synthetic:")
    from commsched.gnn.graph.data import GraphSource
    from commsched.gnn.graph.data import SyntheticSpec as S

    same = GraphSource(synthetic=S(num_nodes=400, num_edges=2000, num_features=4, num_classes=3))
    load_part(tmp_path / "f", 0, 2, source_id=same.identity())
    other = GraphSource(synthetic=S(num_nodes=401, num_edges=2000, num_features=4, num_classes=3))
    with pytest.raises(ValueError, match="made for another graph"):
        load_part(tmp_path / "f", 0, 2, source_id=other.identity())
    assert main(["--dataset", "cora", "--data-root", str(tmp_path / "none"), "--parts", "2",
                 "--out", str(tmp_path / "g")]) == 2
    assert "dataset 'cora'" in capsys.readouterr().err
    json.loads((tmp_path / "f" / "meta.json").read_text())
