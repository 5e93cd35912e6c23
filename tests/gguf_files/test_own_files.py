"""A user's own GGUF files as target and drafter (draftcert.gguf.files, models.load_target("PATH.gguf")):
every architecture transformers reads from GGUF decodes lossless from its path, the --weights
contracts apply, types without a kernel are named once, a hub GGUF follows the hub's cache rules."""

from __future__ import annotations

import pytest
import torch

from draftcert.cli import main
from draftcert.decode import greedy_generate, speculative_generate
from draftcert.gguf.layers import GGUFEmbedding, GGUFLinear, numerics_of
from draftcert.models import ModelUnavailable, load_target
from tests.test_cli_errors import _one_error_line
from tests.tiny_gguf import QT, write_tiny_llama
from tests.tiny_gguf_archs import write_tiny_arch

# the architectures whose tiny files load through draftcert's GGUF loader and decode (tests/tiny_gguf_archs.py)
DECODED = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "stablelm", "starcoder2", "nemotron",
           "falcon", "gpt2", "bloom", "mamba", "qwen2moe", "qwen3moe",
           pytest.param("minimax-m2", marks=pytest.mark.slow), pytest.param("gemma4", marks=pytest.mark.slow)]  # slow: 256 experts; 20 s
Q8 = {k: 8 for k in ("emb", "q", "k", "v", "o", "gate", "up", "down", "out")}


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one per module: the linear kernels and cost curves timed once


@pytest.fixture
def cache(monkeypatch, tmp_path, module_cache):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(module_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", DECODED)
def test_a_tiny_gguf_of_each_architecture_decodes_lossless_from_its_path(arch, cache):
    """Strict speculative decoding with a GGUF drafter of the same architecture (another file, other
    weights) gives the target's own greedy tokens, both loaded from their paths."""
    target_path = write_tiny_arch(cache / f"{arch}-target.gguf", arch, seed=0)
    drafter_path = write_tiny_arch(cache / f"{arch}-drafter.gguf", arch, seed=1)
    target, tok = load_target(str(target_path))
    # from its blocks, not dequantised (gpt2's Conv1D projections are no nn.Linear: its embedding is blocks)
    assert any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in target.modules())
    ids = tok("the cat sat on")["input_ids"]
    ref = greedy_generate(target, ids, 12, eos_token_id=[])  # no end of text: every decode runs its 12 tokens
    out = speculative_generate(target, str(drafter_path), ids, "strict", k=3, max_new_tokens=12, tokenizer=tok,
                               eos_token_id=[])
    assert len(ref) == 12
    assert list(out.tokens) == ref
    assert out.stats.num_draft_tokens > 0  # the drafter drafted, not the target alone


def test_decode_from_two_paths_on_the_command_line(cache, capsys):
    """`draftcert decode --target T.gguf --drafter D.gguf --baseline`: the decode matches the target's
    greedy decoding (baseline_match), with drafts made."""
    import json

    write_tiny_arch(cache / "t.gguf", "qwen2", seed=0)
    write_tiny_arch(cache / "d.gguf", "qwen2", seed=1)
    assert main(["decode", "--target", "t.gguf", "--drafter", "d.gguf", "--prompt", "the cat", "-k", "3",
                 "--max-new-tokens", "8", "--no-progress", "--no-warmup", "--json", "--baseline"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["baseline_match"] is True and summary["num_draft_tokens"] > 0


@pytest.mark.parametrize("weights, contract", [("gguf", "gguf-exact-f32"), ("gguf-q8", "gguf-q8"), ("float32", None)])
def test_the_weights_contracts_apply_to_a_file(weights, contract, cache):
    path = cache / "t.gguf"
    write_tiny_llama(path, tied=False, qtypes=Q8, tokenizer=True)
    model, _ = load_target(str(path), weights=weights)
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    if contract is None:
        assert not layers  # transformers' own load: every weight dequantised
    else:
        assert layers and numerics_of(model) == contract
    exact, _ = load_target(str(path), weights="gguf")
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = exact(x).logits
        diff = (model(x).logits - ref).abs().max().item()
    if weights == "gguf-q8":  # the same weights, 8-bit activations: close, not equal
        assert 0 < diff < 0.05 * ref.abs().max().item()
    else:  # the same weights, float32 sums in another order
        assert diff < 1e-4


def test_types_without_a_kernel_are_dequantised_and_named_in_one_line(cache, capsys):
    path = cache / "mixed.gguf"
    write_tiny_llama(path, tied=False, tokenizer=True,
                     qtypes={**Q8, "down": int(QT.Q4_0), "gate": int(QT.F16), "up": int(QT.Q5_1)})
    model, _ = load_target(str(path))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "without a kernel" in ln]
    assert len(lines) == 1 and "F16 (2), Q4_0 (2), Q5_1 (2)" in lines[0], lines
    types = {m.qtype_name for m in model.modules() if isinstance(m, GGUFLinear)}
    assert types == {"Q8_0"}


def test_a_hub_gguf_offline_is_one_clear_line(cache, capsys):
    with pytest.raises(ModelUnavailable, match="not in the local Hugging Face cache and the hub is unreachable"):
        load_target("no-such-org/no-such-model:model-Q4_K_M.gguf")
    assert main(["decode", "--target", "no-such-org/no-such-model:model-Q4_K_M.gguf", "--drafter", "prompt-lookup",
                 "--prompt", "hi", "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert "model-Q4_K_M.gguf of no-such-org/no-such-model" in line


def test_a_missing_gguf_file_is_one_clear_line(cache, capsys):
    assert main(["decode", "--target", "nope.gguf", "--drafter", "prompt-lookup", "--prompt", "hi"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert "'nope.gguf': no such file" in line


def test_an_architecture_transformers_has_no_model_for_is_one_line(cache, capsys):
    """deci: in transformers' GGUF mapping, but this transformers has no model class for it."""
    path = cache / "deci.gguf"
    try:
        write_tiny_arch(path, "deci")
    except ValueError:  # transformers refuses its config while the file is written: write the file by hand
        from tests.tiny_gguf import add_tiny_tokenizer, gguf

        w = gguf.GGUFWriter(str(path), "deci")
        add_tiny_tokenizer(w)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", torch.zeros(96, 32).numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    assert main(["decode", "--target", str(path), "--drafter", "prompt-lookup", "--prompt", "hi"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert str(path) in line and "transformers cannot read" in line


def test_a_path_loads_as_the_presets_folder_does(cache):
    """The presets' folder (``load_gguf_folder``: model.gguf with its config and tokenizer parsed once)
    and the same file given as a path compute the same logits, bit for bit, with the same tokenizer."""
    from draftcert.gguf.loader import GGUF_FILE, load_gguf_folder, write_gguf_metadata

    folder = cache / "preset"
    folder.mkdir()
    write_tiny_llama(folder / GGUF_FILE, tied=True, tokenizer=True,
                     qtypes={"emb": 8, "q": 12, "k": 3, "v": 6, "o": 14, "gate": 12, "up": 8, "down": 2})
    write_gguf_metadata(folder, {"source": "test"})
    preset, ptok = load_gguf_folder(folder, numerics="gguf-q8")
    mine, tok = load_target(str(folder / GGUF_FILE), weights="gguf-q8")
    assert tok.get_vocab() == ptok.get_vocab() and mine.draftcert_gguf == preset.draftcert_gguf
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(mine(x).logits, preset(x).logits)


@pytest.mark.slow
def test_the_pair_as_paths_profiles_the_same_trace_as_the_preset(tmp_path):
    """`profile` of the Qwen pair's two cached GGUF files, given as paths, writes the same trace columns
    as `--pair qwen2.5-coder` (needs the pair in the cache: skipped otherwise)."""
    import glob

    import pyarrow.parquet as pq

    from draftcert.models.pair import gguf_ready, pair_gguf_dir
    from draftcert.profile import profile

    names = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    if not all(gguf_ready(n) for n in names):
        pytest.skip("the pair's GGUF files are not in the cache")
    paths = [str(pair_gguf_dir(n) / "model.gguf") for n in names]
    prompts = ["Write a Python function that reverses a string."]
    profile(*paths, prompts, out=tmp_path / "paths", max_new_tokens=8, progress=False)
    profile(*names, prompts, out=tmp_path / "preset", max_new_tokens=8, progress=False)
    a, b = (pq.read_table(glob.glob(str(tmp_path / d / "trace" / "*.parquet"))[0]) for d in ("paths", "preset"))
    assert a.num_rows == b.num_rows == 8 and a.schema.names == b.schema.names
    assert all(a.column(n).to_pylist() == b.column(n).to_pylist() for n in a.schema.names)


def test_a_hub_gguf_in_the_local_hugging_face_cache_loads_offline(cache, monkeypatch, capsys):
    """``ORG/NAME:FILE.gguf`` is taken from the local Hugging Face cache first (works offline)."""
    hub = cache / "hf-hub"
    commit = "0" * 40
    snap = hub / "models--some-org--tiny-GGUF" / "snapshots" / commit
    snap.mkdir(parents=True)
    (hub / "models--some-org--tiny-GGUF" / "refs").mkdir()
    (hub / "models--some-org--tiny-GGUF" / "refs" / "main").write_text(commit)
    write_tiny_arch(snap / "tiny-Q8_0.gguf", "qwen3", seed=0)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read when a download is asked for
    model, tok = load_target("some-org/tiny-GGUF:tiny-Q8_0.gguf")
    assert model.draftcert_gguf["file"] == "tiny-Q8_0.gguf" and len(tok) == 96


def test_profile_and_replay_calibrate_take_gguf_paths(cache, capsys):
    """`profile --target T.gguf --drafter D.gguf`, then `replay --calibrate` reloads both from the run's paths."""
    import json

    write_tiny_arch(cache / "t.gguf", "llama", seed=0)
    write_tiny_arch(cache / "d.gguf", "llama", seed=1)
    (cache / "p.txt").write_text("the cat\nhello there\n")
    assert main(["profile", "--target", "t.gguf", "--drafter", "d.gguf", "--prompts", "p.txt", "--out", "run",
                 "--max-new-tokens", "6", "--criteria", "strict", "--no-progress"]) == 0
    run = json.loads((cache / "run" / "run.json").read_text())
    assert (run["target"], run["drafter"], run["model_dtype"]) == ("t.gguf", "d.gguf", numerics_of(load_target("t.gguf")[0]))
    assert main(["replay", "run", "--calibrate", "--no-progress"]) == 0
    replay = json.loads((cache / "run" / "replay.json").read_text())
    assert (cache / "run" / "calibration.json").is_file() and replay["costs"]  # timed on the two files


@pytest.mark.slow
def test_train_drafter_takes_a_gguf_target(cache):
    write_tiny_arch(cache / "t.gguf", "qwen2", seed=0)
    (cache / "p.txt").write_text("\n".join(f"prompt number {i} about the cat" for i in range(8)) + "\n")
    assert main(["train-drafter", "--target", "t.gguf", "--prompts", "p.txt", "--examples", "4", "--max-new-tokens", "8",
                 "--draft-vocab", "32", "--epochs", "1", "--heldout-examples", "0", "--out", "tr", "--quiet"]) == 0
    assert (cache / "tr" / "drafter.safetensors").is_file()
