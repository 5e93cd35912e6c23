"""The wheel cache's download path, under the stderr a test, notebook or wrapper gives it."""

import pytest

from draftcert._cache import PinnedWheel, fetch_wheel


def test_a_download_under_captured_stderr_fails_with_the_download_error_not_fileno(tmp_path, monkeypatch, capsys):
    # capsys's stderr has no file descriptor: handing it to pip's subprocess raised
    # io.UnsupportedOperation('fileno'), which the CLI printed as "--prompts: fileno" (CI, empty HOME).
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path))
    wheel = PinnedWheel("draftcert-no-such-project", "0.0.0", "0" * 64, 0.1)
    with pytest.raises(RuntimeError, match="could not download draftcert-no-such-project==0.0.0"):
        fetch_wheel(wheel)
    assert "downloading draftcert-no-such-project==0.0.0" in capsys.readouterr().err
    assert not (tmp_path / "wheels" / wheel.filename).exists()
