"""Random checkpoint directories (`runtime/worker/random_weights`): weights made at load time, the
same function as a checkpoint holding those values, under every parallel spec; each rank makes
only its shard; a model too large for the device fails before anything is made."""
import math
import subprocess
import sys

import pytest
import torch
from glmc.runtime.worker.checkpoint import expected_tensors
from glmc.runtime.worker.comm import Coords
from glmc.runtime.worker.random_weights import MARKER, RandomWeights, make_random_checkpoint
from glmc.runtime.worker.shards import iter_rank_weights, rank_shards
from glmc.spec import load_spec, model_path
from glmc.tiny import TINY_DIR, make_random_glm, tiny_hf_config
from safetensors.torch import save_file

from tests.compile_util import plan as compiled
from tests.plan_run import build, greedy, rank_worker

STEPS = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A random tiny checkpoint directory and a real checkpoint of the same values."""
    random_dir = make_random_checkpoint(tmp_path_factory.mktemp("random"), tiny_hf_config(), TINY_DIR,
                                        seed=3)
    twin = make_random_checkpoint(tmp_path_factory.mktemp("twin"), tiny_hf_config(), TINY_DIR, seed=3)
    save_file(dict(RandomWeights.in_dir(twin, load_spec(twin).config)), str(twin / "model.safetensors"))
    (twin / MARKER).unlink()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (19, 27, 12)]
    return random_dir, twin, prompts


def test_values_are_made_by_name_and_seed():
    cfg = load_spec(model_path("glm_moe_dsa_tiny")).config
    a, b = RandomWeights(cfg, seed=1), RandomWeights(cfg, seed=2)
    assert a.shapes == expected_tensors(cfg, mtp=True) and len(a) == len(a.shapes)
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(a[name], a[name]) and not torch.equal(a[name], b[name])
    assert a[name].shape == a.shapes[name] and a[name].dtype == torch.float32
    assert torch.equal(a["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert not torch.equal(a[name], a["model.layers.2.self_attn.q_a_proj.weight"])
    with pytest.raises(KeyError):
        a["model.layers.99.mlp.gate.weight"]


def test_random_dir_computes_what_a_checkpoint_of_its_values_does(dirs):
    random_dir, twin, prompts = dirs
    logits, tokens, _ = greedy(build(random_dir), prompts, STEPS)
    want_logits, want_tokens, _ = greedy(build(twin), prompts, STEPS)
    assert torch.equal(logits, want_logits) and torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("parallel,a2a", [("tp2", None), ("dp2ep2", True)])
def test_every_rank_makes_the_same_model(dirs, tmp_path, parallel, a2a):
    from glmc.runtime.worker.launch import spawn
    random_dir, _, prompts = dirs
    logits, tokens, _ = greedy(build(random_dir), prompts, STEPS)
    spawn(rank_worker, 2, str(random_dir), parallel, a2a, prompts, STEPS, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for row, i in enumerate(res["index"]):
            assert torch.allclose(res["logits"][row], logits[i], rtol=1e-5, atol=1e-5), (r, i)  # fp32 sums
            assert torch.equal(res["tokens"][row], tokens[i]), (r, i)


def test_a_rank_makes_only_its_shard(dirs):
    """tp2ep2, rank 1: every tensor made is one it keeps; none of rank 0's experts is made."""
    made = []

    class Counting(RandomWeights):
        def __getitem__(self, name):
            made.append(name)
            return super().__getitem__(name)

    plan = compiled("glm_moe_dsa_tiny", "tp2ep2", device="cpu")
    source = RandomWeights.in_dir(dirs[0], plan.config)
    counting = Counting(source.config, source.seed)
    coords = Coords(1, plan.mesh)
    local = dict(iter_rank_weights(counting, rank_shards(plan.graphs.values(), coords)))
    assert made == list(local) and set(made) == set(rank_shards(plan.graphs.values(), coords)) & set(counting)
    experts = int(plan.config.n_routed_experts)
    assert not [n for n in made if any(f".experts.{e}." in n for e in range(experts // 2))]
    sliced = "model.layers.1.self_attn.q_b_proj.weight"     # column-parallel: rows split over tp
    assert torch.equal(local[sliced], counting[sliced].chunk(2, 0)[1])
    assert local[sliced].untyped_storage().nbytes() == local[sliced].nbytes   # a copy, not a view


def test_glm_at_full_size_fails_clearly_where_it_cannot_fit(tmp_path):
    """`glmc run --weights glm-5.3-random` on this host: GLM-5.3's 753B parameters in fp32 on one
    CPU rank; refused with the sizes before any weight is made."""
    proc = subprocess.run([sys.executable, "-m", "glmc.cli", "run", "--weights", "glm-5.3-random",
                           "--cache-dir", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    ckpt = tmp_path / "glm-5.3-random"
    shapes = RandomWeights.in_dir(ckpt, load_spec(ckpt).config).shapes
    need = sum(math.prod(s) for s in shapes.values()) * 4 / 2**30
    assert f"tp1: rank 0's weights need {need:.1f} GiB (float32)" in proc.stderr, proc.stderr[-2000:]
    assert "making random weights" not in proc.stderr
    assert load_spec(tmp_path / "glm-5.3-random").config.num_hidden_layers == 78


def test_fewer_layers(tmp_path):
    spec = load_spec(make_random_glm(tmp_path / "four", layers=4))
    assert spec.config.num_hidden_layers == 4 and spec.dtypes.weight == "fp8"
    assert spec.config.layer_mlp_types() == ("dense", "dense", "dense", "sparse")
    with pytest.raises(ValueError, match="layers: 0"):
        make_random_glm(tmp_path / "none", layers=0)
