"""Real vLLM 0.33.0 classes on CPU (issue 14): a tiny Llama config.json (no weights, no
tokenizer), CPU KV buffers, NIXL over UCX/TCP, a gloo process group. Built once per session:
importing vLLM and building a ModelConfig takes tens of seconds on a loaded 2-core machine."""

import json
import os
import socket

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK = 32  # the CPU attention backend wants multiples of 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def nixl_progress_threads_sleep():
    """NIXL's Python agent makes every agent with its progress thread's delay 0: the thread
    busy-polls a core. This suite makes about twenty agents in one process (one per worker, and
    vLLM frees none), and on a 2-core machine their threads starved everything else: a run took
    2 to 20 minutes, and once did not end. Every agent made here with a delay of 0 gets 1 ms.
    It wraps the agent constructor below the connector's own wrapper, so a test that looks at
    the delay the connector asks for still sees that."""
    import sys

    from vllm.distributed.nixl_utils import NixlWrapper

    bind = sys.modules[NixlWrapper.__module__].nixlBind
    real = bind.nixlAgent

    def agent(name, config):
        if not config.pthrDelay:
            config.pthrDelay = 1000
        return real(name, config)

    bind.nixlAgent = agent
    yield
    bind.nixlAgent = real


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


@pytest.fixture(scope="session")
def model_config(model_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=512)


@pytest.fixture(scope="session")
def kv_cache_config():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    n = 64
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[KVCacheTensor(size=page * n, layers=[l], layer_stride=page * n, block_stride=page) for l in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


@pytest.fixture(scope="session")
def make_vllm_config(model_config):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    def make(connector: str, role: str, engine_id: str, lease: float = 30, **extra):
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path="kvlease.vllm" if connector == "KvleaseConnector" else None,
            kv_role=role,
            kv_buffer_device="cpu",
            engine_id=engine_id,
            kv_connector_extra_config={"kv_lease_duration": lease, **extra},
        )
        vc = VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=kv,
            cache_config=CacheConfig(block_size=BLOCK),
        )
        vc.cache_config.kv_cache_layout = "LBNHC"  # what the engine core would resolve
        return vc

    return make


@pytest.fixture(scope="session")
def distributed(make_vllm_config):
    """The worker role needs vLLM's process groups: one rank, gloo."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(make_vllm_config("NixlConnector", "kv_producer", "init")):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
    return True


@pytest.fixture(scope="session")
def create(make_vllm_config, kv_cache_config, distributed):
    """create(connector, role_str, 'scheduler'|'worker', engine_id) -> a connector built by
    vLLM's own KVConnectorFactory, as `vllm serve` would."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    made = []

    def build(connector: str, kv_role: str, which: str, engine_id: str, **kw):
        vc = make_vllm_config(connector, kv_role, engine_id, **kw)
        role = KVConnectorRole.SCHEDULER if which == "scheduler" else KVConnectorRole.WORKER
        with set_current_vllm_config(vc):
            c = KVConnectorFactory.create_connector(vc, role, kv_cache_config)
        made.append(c)
        return c

    yield build
    for c in made:
        try:
            c.shutdown()
        except Exception:
            pass
