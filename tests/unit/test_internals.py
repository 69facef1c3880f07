"""rl/patches/internals.py: every internal name rl reads is listed once, found in the installed libraries, shown in
docs/architecture.md as listed, and a process whose library lost one fails its start naming it."""

import re
from pathlib import Path

import pytest

from rl.patches import internals
from rl.patches.internals import INTERNALS, PROCESSES, Internal, check_internals, declared, missing
from rl.patches.targets import PatchTargetMissing

ROOT = Path(__file__).resolve().parents[2]


def test_every_internal_rl_reads_is_in_the_installed_libraries():
    assert missing(INTERNALS, "cpu") == []
    assert {row.process for row in INTERNALS} == set(PROCESSES)


def test_the_architecture_doc_shows_the_table_as_listed():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown = re.search(r"<!-- internals table: generated from rl/patches/internals.py -->\n(.*?)\n<!-- end of the",
                      doc, re.S)
    assert shown is not None and shown.group(1) == internals.table(), (
        "docs/architecture.md's internals table differs from rl/patches/internals.py: paste "
        "`python -m rl.patches.internals` between its markers")


def test_a_process_whose_library_lost_a_name_fails_its_start_naming_each(monkeypatch):
    gone = (Internal("verifiers.v1.serve.server.EnvServer", ("_handle", "rl_gone"), "envs/x.py", "a test"),
            Internal("verifiers.v1.serve.no_such_module", (), "envs/x.py", "a test"),
            Internal("vllm.v1.worker.cpu_model_runner.CPUModelRunner", ("rl_gone_too",), "patches/x.py", "a test",
                     "cpu"))
    monkeypatch.setattr(internals, "INTERNALS", gone)
    with pytest.raises(PatchTargetMissing, match=r"EnvServer\.rl_gone \(verifiers \S+\); "
                                                 r"verifiers\.v1\.serve\.no_such_module \(verifiers"):
        check_internals("episodes")
    check_internals("inference", "cuda")  # a CPU runner's member is not read on a GPU host
    with pytest.raises(PatchTargetMissing, match=r"CPUModelRunner\.rl_gone_too"):
        check_internals("inference", "cpu")


def test_a_member_counts_where_the_class_or_its_bases_set_or_read_it():
    class Base:
        def __init__(self):
            self._made_in_init = 1

    class Child(Base):
        field: int

    assert declared(Child, "_made_in_init") and declared(Child, "field") and declared(Child, "__init__")
    assert not declared(Child, "never_named")
