"""Hugging Face round trip with `transformers` (a tiny random Llama, nothing downloaded): plait's
model exported loads with no missing keys and gives the same logits; a Hugging Face model
imported gives the same logits in plait. fp32 on the CPU: equal to about 1e-6 (the matmuls'
order is the same; the rotary formulas differ in rounding only), asserted at 1e-5."""

from __future__ import annotations

import json

import pytest
import torch

from plait import cli
from plait.checkpoint import finish, meta
from plait.checkpoint.rank_state import load_full, one_process
from plait.config.schema import load_config
from plait.model import build_model
from plait.planner.price import DEGREES, with_degrees
from plait.train.checks import validate
from plait.train.dry_run import describe_rank

transformers = pytest.importorskip("transformers")

MODEL = ["model.preset=tiny", "model.n_layers=2", "model.vocab_size=300", "model.rope_theta=500000"]


def _tokens(vocab):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def _checkpoint_of(model, cfg, path):
    """A plait checkpoint of `model` alone, in one process (as `plait convert --from` writes)."""
    import torch.distributed.checkpoint as dcp

    sd = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    sd["train.step"] = torch.tensor(0)
    with one_process():
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    finish(path, meta(cfg, 0, 1, contents=("model",)))


def test_export_loads_in_transformers_with_equal_logits(tmp_path, capsys):
    cfg = load_config(None, MODEL)
    model = build_model(cfg.model.args(), seed=3)
    _checkpoint_of(model, cfg, tmp_path / "ck")
    cli.main(["convert", "--to", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, torch_dtype=torch.float32)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {"rms_norm_eps", "head_dim", "intermediate_size"} <= config.keys()
    tokens = _tokens(cfg.model.args().vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)


def test_import_from_transformers_gives_equal_logits(tmp_path, capsys):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    cli.main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    said = capsys.readouterr().out
    settings = said.split("checkpoint.resume=")[1].split()[1:]
    args = load_config(None, ["model.preset=tiny", *settings]).model.args()
    assert args.ffn_dim == 176 and args.norm_eps == 1e-6 and args.rope_theta == 20000.0
    model = build_model(args, seed=0, device="meta").to_empty(device="cpu")
    model.load_state_dict(load_full(tmp_path / "ck"))
    tokens = _tokens(300)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


def test_a_mixture_of_experts_is_refused_in_one_line(tmp_path, capsys):
    cfg = load_config(None, ["model.preset='tiny-moe'"])
    _checkpoint_of(build_model(cfg.model.args(), seed=3), cfg, tmp_path / "ck")
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "--to", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("plait: error: CKPT:") and "experts" in err
    assert not (tmp_path / "hf").exists()


# -- model.hf: the transformers modules themselves ------------------------------------------------

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma", "gemma2", "stablelm",
            "starcoder2", "gpt-neox", "olmo2", "phi3", "gpt2", "falcon", "falcon-classic", "bloom"]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    from hf_models import write_model

    root = tmp_path_factory.mktemp("families")
    return {f: write_model(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_plaits_pieces_of_a_transformers_model_compute_its_forward(hf_folders, family):
    """`HFCausalLM` runs the model's own modules in the pieces a pipeline chunk needs (embed,
    block arguments, layers, head): its logits equal the transformers model's exactly (the same
    operations in the same order). A family with no plan is the module whole."""
    from plait.model.hf import HFCausalLM, PlainCausalLM, load_hf

    model = load_hf(hf_folders[family]).eval()
    assert isinstance(model, PlainCausalLM if family == "bloom" else HFCausalLM)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        hf_folders[family], dtype=torch.float32).eval()  # its own choice, as plait's
    tokens = _tokens(256)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(input_ids=tokens).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mistral", "gemma", "gemma2", "stablelm", "starcoder2",
                                    "gpt-neox", "olmo2", "phi3", "gpt2", "falcon", "mixtral"])
def test_a_checkpoint_of_each_family_exports_to_a_folder_transformers_loads(hf_folders, family,
                                                                            tmp_path, capsys):
    """`plait convert --to hf` of a `model.hf` checkpoint: transformers loads the folder with no
    missing, unexpected or mismatched key, and computes the checkpoint's logits (the weights
    moved off the source folder's first, so the export cannot pass by copying it). GPT-NeoX's
    pieces live under `gpt_neox.`, the others' under `model.` (`Family.modules`)."""
    from plait.model.hf import load_hf

    folder = hf_folders[family]
    model = load_hf(folder).eval()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), alpha=0.01)
    _checkpoint_of(model, load_config(None, [f"model.hf='{folder}'"]), tmp_path / "ck")
    cli.main(["convert", "--to", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    tokens = _tokens(256)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=tokens).logits, model(tokens),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt-neox", "falcon-classic"])
def test_model_attention_eager_computes_the_familys_eager_attention(hf_folders, family):
    """`model.attention = "eager"`: a planned family's attention runs through plait's entry
    (where context parallelism puts its kernel) into the family's own eager function, with the
    causal mask SDPA implies made explicit (Falcon's attention, its own, is given it); the
    logits equal transformers' eager model's, and its SDPA model's to float rounding. With
    documents, each attends within its own."""
    from plait.model.documents import Documents
    from plait.model.hf import load_hf

    model = load_hf(hf_folders[family], attention="eager").eval()
    assert getattr(model.args, "plait_inner_attention", model.args._attn_implementation) == \
        "eager"
    eager, sdpa = (transformers.AutoModelForCausalLM.from_pretrained(
        hf_folders[family], dtype=torch.float32, attn_implementation=a).eval()
        for a in ("eager", "sdpa"))
    tokens = _tokens(256)
    with torch.no_grad():
        got = model(tokens)
        torch.testing.assert_close(got, eager(input_ids=tokens).logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, sdpa(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
        ids = torch.tensor([[0] * 5 + [1] * 19] * tokens.shape[0])  # two documents per row
        split = model(tokens, documents=Documents.whole(ids))
        second = eager(input_ids=tokens[:, 5:]).logits  # the second document alone
        torch.testing.assert_close(split[:, 5:], second, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_windows_shorter_than_the_sequence_are_applied(tmp_path, family):
    """Mistral's window on every layer, Gemma2's on every other (transformers passes each
    layer's to the attention function): plait's entry narrows the causal mask (or the
    documents') to it, for SDPA and eager alike; the logits equal transformers' exactly, and
    differ from the windowless model's."""
    from hf_models import write_model

    from plait.model.documents import Documents
    from plait.model.hf import load_hf

    folder = write_model(tmp_path / family, family, sliding_window=8)
    tokens = _tokens(256)
    for attention in ("sdpa", "eager") if family == "mistral" else ("eager",):  # Gemma2: no SDPA
        model = load_hf(folder, attention=attention).eval()
        reference, wide = (transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=attention, **changes).eval()
            for changes in ({}, {"sliding_window": 4096}))
        with torch.no_grad():
            got = model(tokens)
            torch.testing.assert_close(got, reference(input_ids=tokens).logits, rtol=0, atol=0)
            assert (got - wide(input_ids=tokens).logits).abs().max() > 1e-2
            ids = torch.tensor([[0] * 5 + [1] * 19] * tokens.shape[0])  # two documents per row
            split = model(tokens, documents=Documents.whole(ids))
            torch.testing.assert_close(split[:, 5:], reference(input_ids=tokens[:, 5:]).logits,
                                       rtol=1e-5, atol=1e-5)


def test_zero3_units_of_a_family_without_a_plan_are_its_decoder_layers(hf_folders):
    """A transformers family plait has no plan for gets ZeRO-3 units by the classes it names in
    `_no_split_modules` (BLOOM's `BloomBlock`: one unit per layer, not the whole model gathered
    at once); `parallel.wrap` chooses others by class name or size, and names a class the model
    lacks with the ones it has."""
    from plait.model.hf import load_hf
    from plait.parallel.engines.units import unit_modules
    from plait.parallel.wrap import policy_of

    model = load_hf(hf_folders["bloom"], device="meta")
    assert [c.__name__ for c in model.unit_classes] == ["BloomBlock"]
    units = unit_modules(model, policy_of(model))
    assert [type(u[0]).__name__ for u in units] == ["PlainCausalLM", "BloomBlock", "BloomBlock"]
    mlps = unit_modules(model, policy_of(model, "BloomMLP, BloomAttention"))
    assert [type(u[0]).__name__ for u in mlps[1:]] == ["BloomAttention", "BloomMLP"] * 2
    assert policy_of(model, "1000").min_params == 1000
    with pytest.raises(ValueError, match=r"^parallel.wrap: no module of class LlamaDecoderLayer "
                                         r"in this model; its classes with parameters: "):
        policy_of(model, "LlamaDecoderLayer")


def test_a_family_without_a_plan_compiles_its_decoder_layers(hf_folders):
    """`train.compile` (on by default on CUDA) compiles an unplanned family's decoder layers, the
    units ZeRO-3 gathers: it refused every such model ("no block to compile") until the GPU
    test of the families (`tests/dist/test_families_gpu.py`) trained BLOOM."""
    from plait.model.hf import load_hf
    from plait.parallel.compile import blocks

    model = load_hf(hf_folders["bloom"], device="meta")
    assert [type(b).__name__ for b in blocks(model)] == ["BloomBlock", "BloomBlock"]


def _refusal(*overrides, nproc=4):
    from plait.config.schema import ConfigError
    from plait.train.checks import validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(None, list(overrides)), nproc)
    return str(e.value)


def test_what_a_layout_cannot_do_with_a_hf_model_is_refused_in_one_line(hf_folders, tmp_path):
    bloom, llama = hf_folders["bloom"], hf_folders["llama"]
    assert _refusal(f"model.hf='{bloom}'", "parallel.tp=2").startswith(
        "parallel.tp: BloomForCausalLM has no plait plan (planned: LlamaForCausalLM, ")
    assert _refusal(f"model.hf='{bloom}'", "parallel.zero=1", "parallel.dp=2",
                    "train.activation_checkpointing=selective", nproc=2) == \
        "train.activation_checkpointing: BloomForCausalLM has no plait plan naming its " \
        "attention core; 'full' recomputes each decoder layer"
    assert _refusal(f"model.hf='{bloom}'", "parallel.zero=3", "parallel.wrap=BloomLayer") == \
        "parallel.wrap: BloomForCausalLM has no module class BloomLayer; its decoder layer is " \
        "BloomBlock"
    assert _refusal(f"model.hf='{llama}'", "parallel.zero=3", "parallel.wrap=Block") == \
        "parallel.wrap: LlamaForCausalLM has no module class Block; its decoder layer is " \
        "LlamaDecoderLayer"
    assert _refusal(f"model.hf='{bloom}'", "data.document_mask=true").startswith(
        "data.document_mask: BloomForCausalLM has no plait plan (planned: ")
    assert _refusal(f"model.hf='{hf_folders['gpt2']}'", "data.document_mask=true") == \
        "data.document_mask: GPT2LMHeadModel adds learned positions to its embeddings, which " \
        "would not restart at each document; set it to false"
    assert _refusal(f"model.hf='{tmp_path}'") == \
        f"model.hf: {tmp_path} has no config.json; give a folder that transformers' " \
        "save_pretrained wrote"
    # The family's plan says which of its config's fields tp must divide (its names, not plait's).
    assert _refusal(f"model.hf='{llama}'", "parallel.tp=4", "parallel.dp=1") == \
        "parallel.tp: tp=4 must divide num_key_value_heads=2"
    assert _refusal(f"model.hf='{llama}'", "model.dim=64") == \
        "model.dim: the folder's config.json decides the model with model.hf; drop this key"
    from hf_models import write_model

    tied = write_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert _refusal(f"model.hf='{tied}'", "parallel.pp=2").startswith(
        "parallel.pp: the model ties its input embedding and output head (tie_word_embeddings)")
    window = write_model(tmp_path / "window", "mistral", sliding_window=16)
    assert _refusal(f"model.hf='{window}'", "data.seq_len=32", "parallel.cp=2", nproc=2) == \
        "parallel.cp: data.seq_len 32 exceeds the model's sliding window (16), which plait's " \
        "context-parallel kernels do not apply; set cp = 1, or seq_len <= 16"
    assert _refusal(f"model.hf='{bloom}'", "model.attention=flash") == \
        "model.attention: one of auto, sdpa, eager, not 'flash'"
    assert _refusal("model.attention=eager") == \
        "model.attention: chooses a Hugging Face model's attention (with model.hf); plait's " \
        "Llama computes its own: drop this key"
    assert _refusal(f"model.hf='{bloom}'", "model.attention=sdpa", nproc=1) == \
        "model.attention: transformers computes BloomForCausalLM with its own attention only " \
        "(no SDPA); use 'auto' or 'eager'"
    assert _refusal(f"model.hf='{hf_folders['gemma2']}'", "parallel.cp=2", nproc=2) == \
        "parallel.cp: Gemma2ForCausalLM with attn_logit_softcapping set (soft-capped attention " \
        "scores) computes an attention plait's context-parallel kernels do not; set cp = 1"
    per_head = write_model(tmp_path / "qk", "stablelm", qk_layernorm=True)
    assert _refusal(f"model.hf='{per_head}'", "parallel.tp=2", nproc=2) == \
        "parallel.tp: StableLmForCausalLM with qk_layernorm set (a LayerNorm per head for " \
        "queries and keys) has layers plait's plan does not split by tp; set tp = 1"


def test_falcons_configs_its_plan_does_not_cover_are_refused_or_run_without_it(hf_folders,
                                                                              tmp_path):
    """Falcon's multi-query attention (one key/value head, its first architecture) under tp;
    its own attention (SDPA called in its module) under cp; with ALiBi it has no plan (dp and
    ZeRO only), which the refusal of pp says, and builds as the module whole."""
    from hf_models import write_model

    from plait.model.hf import PlainCausalLM, load_hf

    multi_query = write_model(tmp_path / "mq", "falcon-classic", multi_query=True)
    assert _refusal(f"model.hf='{multi_query}'", "parallel.tp=2", nproc=2) == \
        "parallel.tp: FalconForCausalLM with multi_query set (one key/value head shared by " \
        "every query head, which tp would copy to every rank) has layers plait's plan does " \
        "not split by tp; set tp = 1"
    assert _refusal(f"model.hf='{hf_folders['falcon']}'", "parallel.cp=2", nproc=2) == \
        "parallel.cp: FalconForCausalLM's attention computes itself (SDPA called in its " \
        "module), where plait's context-parallel kernels cannot go; set cp = 1"
    alibi = write_model(tmp_path / "alibi", "falcon-classic", alibi=True)
    refused = _refusal(f"model.hf='{alibi}'", "parallel.pp=2", nproc=2)
    assert refused.startswith("parallel.pp: FalconForCausalLM has no plait plan (planned: ")
    assert ", but not with alibi set); it trains with dp and ZeRO-1/2/3: set pp = 1" in refused
    assert isinstance(load_hf(alibi), PlainCausalLM)


def test_a_folder_that_is_not_a_causal_lm_is_refused_in_one_line(tmp_path):
    """An encoder would train as a "causal LM" with a fresh head and no causal mask; a folder
    asking for its own code, or of a type transformers does not know, would end in a traceback."""
    import json

    bert = tmp_path / "bert"
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32)).save_pretrained(bert)
    assert _refusal(f"model.hf='{bert}'", nproc=1).startswith(
        f"model.hf: {bert}/config.json: BertForMaskedLM is an encoder or another head, not a "
        "causal language model")
    for name, changes, said in (
            ("remote", {"auto_map": {"AutoModelForCausalLM": "mine.Model"}}, "auto_map"),
            ("unknown", {"model_type": "nothing-known"}, "model_type 'nothing-known' is not"),
            ("headless", {"architectures": ["LlamaModel"]}, "LlamaModel is an encoder or"),
            ("made up", {"architectures": ["FooBarForCausalLM"]},  # a decoder's name, unknown
             "FooBarForCausalLM, a class this transformers does not have (model_type 'llama' "
             "builds LlamaForCausalLM)")):
        folder = tmp_path / name
        folder.mkdir()
        raw = json.loads((_llama_folder(tmp_path) / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, **changes}))
        refusal = _refusal(f"model.hf='{folder}'", nproc=1)
        assert refusal.startswith("model.hf: ") and said in refusal and "\n" not in refusal


def test_a_cut_weights_file_is_refused_before_launch(tmp_path):
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(_llama_folder(tmp_path), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert _refusal(f"model.hf='{folder}'", nproc=1).startswith(
        f"model.hf: {weights} is not a whole safetensors file (")


def _llama_folder(tmp_path):
    from hf_models import write_model

    folder = tmp_path / "llama"
    return folder if folder.exists() else write_model(folder, "llama")


def test_import_refuses_what_plaits_llama_cannot_compute(tmp_path, capsys):
    """Rotary scaling (Llama 3.1's "llama3" rope type), biases, another activation or another
    architecture would compute something else: refused in one line naming the field."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' own progress bar, where no earlier test switched it off
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    assert e.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("plait: error: HF_DIR: ") and "rope_type 'llama3'" in said, said
    assert "\n" not in said


def test_the_planner_places_the_transformers_model_itself(hf_folders, capsys):
    """`plait plan model.hf=DIR`: the parameter count is the transformers model's, a family with
    no plan is offered data parallelism and ZeRO alone, and its activations are the model's own
    step traced on fake tensors (what `--dry-run` prints; `test_hf_models` checks a pinned plan
    against a real run), not plait's Llama block: no plan says otherwise."""
    unplanned = hf_folders["bloom"]
    cli.main(["plan", f"model.hf={unplanned}", "--gpus", "4", "--json", "data.seq_len=32",
              "train.global_batch=8"])
    plans = json.loads(capsys.readouterr().out)
    want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(
        unplanned).parameters())
    assert plans and all(p["params"] == want for p in plans)
    assert all(p["tp"] == p["pp"] == p["cp"] == p["ep"] == 1 for p in plans)
    assert not any("plait's Llama" in w for p in plans for w in p["warnings"])
    cfg = load_config(None, [f"model.hf='{unplanned}'", "data.seq_len=32", "train.global_batch=8"])
    for p in plans:
        pinned = with_degrees(cfg, **{k: p[k] for k in DEGREES if k != "dp"})
        dry = describe_rank(pinned, validate(pinned, 4), 0)
        assert p["memory_bytes"]["activations"] == dry["activations"], p


def test_an_export_drops_the_sources_remote_code_entry_and_says_so(tmp_path, capsys):
    """A model.hf run's checkpoint exports with its source folder's config.json; where that
    folder has since gained an `auto_map` (code of its own, which transformers would import with
    trust_remote_code), the exported config drops it, in a note."""
    from hf_models import write_model

    from plait.model.hf import load_hf

    folder = write_model(tmp_path / "llama", "llama")
    cfg = load_config(None, [f"model.hf='{folder}'"])
    _checkpoint_of(load_hf(folder), cfg, tmp_path / "ck")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**raw, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))
    cli.main(["convert", "--to", "hf", str(tmp_path / "hf"), str(tmp_path / "ck")])
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "auto_map" not in exported and exported["model_type"] == "llama"
    assert "dropped auto_map" in capsys.readouterr().err
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # no remote code asked
