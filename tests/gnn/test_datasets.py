"""Named data sets: the data root (default and --data-root), torch_geometric's download
when files are missing (never reached here: the network is refused), one clear error when
neither the files nor the network are there, and ``commsched datasets``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from commsched.cli import main as cli_main
from commsched.config import read_env
from commsched.gnn.graph.cli import partition_main
from commsched.gnn.graph.data import (
    DatasetUnavailable,
    GraphSource,
    dataset_status,
    find_dataset,
    graph_fingerprint,
    load_dataset,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="the shared data copies (../shared/data) are not present")

# graph_fingerprint of the graphs as read from the shared copies by the loader that read
# the raw folders directly (before downloads): the reading must not change
CORA_FP = "6488347eb7bd401c0fd3dd23"
CORA_DIRECTED_FP = "eb4221be71cf95c68c0e87c3"
CITESEER_FP = "5dc536d4661447f10e53a54c"
MINESWEEPER_SPLIT3_FP = "e95ea2605de871a9582f8231"


def test_default_data_root_is_read_from_the_environment(tmp_path, monkeypatch):
    assert read_env({"COMMSCHED_DATA": str(tmp_path)}).data_root == tmp_path
    assert read_env({"XDG_CACHE_HOME": "/c"}).data_root == Path("/c/commsched/data")
    assert read_env({}).data_root == Path.home() / ".cache" / "commsched" / "data"
    monkeypatch.setenv("COMMSCHED_DATA", str(tmp_path))
    assert GraphSource(kind="dataset", name="Cora").data_root == str(tmp_path)
    assert GraphSource(kind="dataset", name="cora", data_root="/x").data_root == "/x"
    with pytest.raises(ValueError, match="unknown dataset 'reddit'.*--graph"):
        GraphSource(kind="dataset", name="reddit")


@needs_data
def test_shared_copies_read_as_before():
    g = load_dataset("cora", DATA)
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (2708, 10556, 1433, 7)
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (140, 500, 1000)
    assert torch.equal(g.train_mask.nonzero().view(-1), torch.arange(140))  # the Planetoid split
    assert graph_fingerprint(g) == CORA_FP  # edges, features, labels and masks, byte for byte
    assert graph_fingerprint(load_dataset("cora", DATA, directed=True)) == CORA_DIRECTED_FP
    assert graph_fingerprint(load_dataset("citeseer", DATA)) == CITESEER_FP
    assert graph_fingerprint(load_dataset("minesweeper", DATA, split=3)) == MINESWEEPER_SPLIT3_FP


def _empty_root_fails(name: str, root: Path) -> str:
    with pytest.raises(DatasetUnavailable) as e:
        load_dataset(name, root)
    msg = str(e.value)
    assert "\n" not in msg and f"dataset {name!r}" in msg and str(root) in msg
    assert "could not be downloaded" in msg and "connect to the internet" in msg
    assert not root.exists(), "a failed download leaves nothing behind"
    return msg


@pytest.mark.parametrize("name", ["cora", "tolokers", "squirrel"])  # Planetoid, PyG class, download_url
def test_missing_files_without_network_is_one_clear_error(name, tmp_path, no_network):
    root = tmp_path / "data"
    msg = _empty_root_fails(name, root)
    sub = "planetoid/Cora" if name == "cora" else f"heterophilous/{name}"
    assert str(root / sub / "raw") in msg  # where to put the files by hand


def test_cli_without_files_or_network_exits_2(tmp_path, no_network, capsys, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setenv("COMMSCHED_DATA", str(root))  # the default root: no --data-root given
    assert partition_main(["--dataset", "cora", "--parts", "2", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "dataset 'cora'" in err and str(root) in err
    assert cli_main(["datasets", "--download", "citeseer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dataset 'citeseer'" in err and str(root) in err


@needs_data
def test_download_lands_where_it_is_found(tmp_path, monkeypatch):
    """The download path of squirrel (PyG's download_url, here serving the shared copy)
    writes into the data root's layout, and the graph read from there is the shared one."""
    import torch_geometric.data

    urls = []

    def fake_download(url, folder, log=True, filename=None):
        urls.append(url)
        Path(folder).mkdir(parents=True, exist_ok=True)
        return shutil.copy(DATA / "heterophilous" / "squirrel" / "raw" / "squirrel.npz", folder)

    monkeypatch.setattr(torch_geometric.data, "download_url", fake_download)
    g = load_dataset("squirrel", tmp_path)
    assert urls == ["https://github.com/yandex-research/heterophilous-graphs/raw/main/data/squirrel.npz"]
    assert find_dataset("squirrel", tmp_path) == tmp_path / "heterophilous/squirrel/raw/squirrel.npz"
    assert graph_fingerprint(g) == graph_fingerprint(load_dataset("squirrel", DATA))
    load_dataset("squirrel", tmp_path)  # present now: no second download
    assert len(urls) == 1


@needs_data
def test_datasets_command_lists_what_is_present(tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    shutil.copytree(DATA / "planetoid" / "Cora", root / "planetoid" / "Cora")
    monkeypatch.setenv("COMMSCHED_DATA", str(root))
    assert [n for n, p in dataset_status() if p is not None] == ["cora"]
    assert cli_main(["datasets"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"data root: {root}"
    rows = {line.split()[0]: line.split()[1] for line in out[1:]}
    assert rows["cora"] == "present" and rows["citeseer"] == "missing"
    assert rows["tolokers"] == "missing" and rows["synthetic"] == "embedded"
    assert cli_main(["datasets", "--data-root", str(DATA)]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert {n for n, s in rows.items() if s == "present"} == {
        "cora", "citeseer", "tolokers", "minesweeper", "squirrel", "chameleon"}
    # a raw folder missing a file is not taken for the data set
    (root / "planetoid" / "Cora" / "raw" / "ind.cora.graph").unlink()
    assert find_dataset("cora") is None
    with pytest.raises(SystemExit):
        cli_main(["datasets", "--download", "reddit"])
    assert "invalid choice" in capsys.readouterr().err
