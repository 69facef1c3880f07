"""Test hooks: one armed hook is taken once, however many servers race for it."""

import threading

from rl.inference import hooks


def test_of_servers_racing_for_one_hook_exactly_one_takes_it(tmp_path, monkeypatch):
    """Two servers receiving one step over the wire both look for `corrupt_receive`: one must get it, the other
    nothing (it failed with FileNotFoundError when both saw the file and one unlinked it first)."""
    monkeypatch.setenv(hooks.HOOK_DIR_ENV, str(tmp_path))
    for _ in range(50):
        (tmp_path / "corrupt_receive").write_text("model.layers.0.mlp.down_proj.weight\n")
        start, results = threading.Barrier(8), []

        def race():
            start.wait()
            try:
                results.append(hooks.take("corrupt_receive"))
            except OSError as e:
                results.append(e)

        threads = [threading.Thread(target=race) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(results, key=str) == [None] * 7 + ["model.layers.0.mlp.down_proj.weight"], results
        assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_unarmed_hook_or_no_hook_directory_takes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(hooks.HOOK_DIR_ENV, str(tmp_path))
    assert hooks.take("corrupt_receive") is None
    monkeypatch.delenv(hooks.HOOK_DIR_ENV)
    assert hooks.take("corrupt_receive") is None
