"""Two real processes x 4 CPU devices joined by jax.distributed (gloo) run one tp=8 instance: the leader
schedules, the follower runs the same steps, the host KV tier's copies too; outputs equal one process's. Killing
the follower makes the leader fail its requests with UNAVAILABLE and exit non-zero instead of hanging. The step
channel, attacked from the network while the leader waits for its follower: a pickle that would create a file, a
silent connection and a follower with the wrong secret are refused, and the real follower joins all the same."""
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from sharding.step_channel import MAGIC, NONCE_BYTES, AuthenticationError, FollowerChannel

from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
from tests.support import hf_models
from serving.process import REPO_ROOT

pytestmark = pytest.mark.e2e

WORKER = os.path.join(REPO_ROOT, "tests", "support", "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    import transformers as tf
    d = tmp_path_factory.mktemp("multihost") / "llama"
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**hf_models.COMMON, "hidden_size": 128, "num_attention_heads": 8,
                                          "num_key_value_heads": 2})).save_pretrained(d)
    return str(d)


SECRET = "multihost-test-secret-0123456789"


def _start(model_dir, out, max_tokens, log_dir, go_file="", host_kv=False):
    coord, step = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=REPO_ROOT, MESHSERVE_STEP_SECRET=SECRET, MULTIHOST_FOLLOWER_GO_FILE=go_file,
               MULTIHOST_HOST_KV="1" if host_kv else "")
    procs = []
    for pid in (0, 1):
        log = open(os.path.join(log_dir, f"p{pid}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-u", WORKER, str(pid), str(coord), str(step), model_dir, out,
                                       str(max_tokens)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT))
    return procs, step


class _CreatesAFile:
    """Unpickling this creates `path` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _attack_step_channel(leader, port, log, marker):
    """While the leader waits for its follower: a pickled payload, a silent connection (left open), a follower
    with the wrong secret. Returns the silent socket."""
    deadline = time.monotonic() + 600
    while True:  # until the leader listens (it builds its engine first)
        assert leader.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
        try:
            attacker = socket.create_connection(("127.0.0.1", port), timeout=30)
            break
        except OSError:
            time.sleep(0.2)
    payload = pickle.dumps(_CreatesAFile(marker))
    pickle.loads(payload).close()  # the payload does create the file when unpickled
    assert os.path.exists(marker)
    os.remove(marker)
    with attacker:
        attacker.sendall(struct.pack("<Q", len(payload)) + payload)  # the old wire format: length + pickle
        got = b""
        try:
            while chunk := attacker.recv(4096):
                got += chunk
        except ConnectionResetError:  # closed with the payload unread
            pass
        assert len(got) <= len(MAGIC) + NONCE_BYTES  # at most the leader's hello, then closed
    silent = socket.create_connection(("127.0.0.1", port), timeout=30)
    with pytest.raises(AuthenticationError, match="refused this follower"):
        FollowerChannel("127.0.0.1", port, 1, secret=b"the-wrong-secret-0123456789")
    return silent


def test_two_processes_match_one(model_dir, tmp_path):
    out, marker, go = str(tmp_path / "out.json"), str(tmp_path / "pwned"), str(tmp_path / "go")
    (leader, follower), step_port = _start(model_dir, out, 10, str(tmp_path), go_file=go, host_kv=True)
    log = tmp_path / "p0.log"
    try:
        silent = _attack_step_channel(leader, step_port, log, marker)
        open(go, "w").close()
        deadline = time.monotonic() + 60
        while "follower process 1 joined" not in open(log).read():
            assert leader.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
            time.sleep(0.05)
        # The silent connection is still in its handshake (10 s deadline): it did not hold the follower up.
        silent.setblocking(False)
        assert silent.recv(100)[:len(MAGIC)] == MAGIC
        with pytest.raises(BlockingIOError):
            silent.recv(100)
        silent.close()
        assert leader.wait(timeout=600) == 0, open(log).read()[-3000:]
        assert follower.wait(timeout=60) == 0, open(tmp_path / "p1.log").read()[-3000:]
    finally:
        for p in (leader, follower):
            p.kill()
    assert not os.path.exists(marker)
    text = open(log).read()
    assert "wrong protocol bytes" in text and "without the shared secret" in text, text[-3000:]
    result = json.load(open(out))
    assert result["devices"] == 8 and result["processes"] == 2
    llm = LLM(model_dir, warmup=False, page_size=8, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
              min_token_bucket=64, enable_prefix_caching=False)
    prompts = [hf_models.random_prompt(n, 160, seed=n) for n in (5, 17, 40, 3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    # then the host KV tier (the leader's 16 device pages): each process offloads and loads its own devices' shards
    # as the leader announces the copies; the prefixes cycled through it hit the host tier
    assert result["prompts"][:4] == prompts and len(result["prompts"]) == 12
    expected += [llm.generate([p], params)[0].token_ids for p in result["prompts"][4:]]
    assert result["tokens"] == expected and result["host_hits"] > 0


def test_killed_follower_fails_requests_instead_of_hanging(model_dir, tmp_path):
    out = str(tmp_path / "out.json")
    (leader, follower), _ = _start(model_dir, out, 400, str(tmp_path))
    log = tmp_path / "p0.log"
    try:
        deadline = time.monotonic() + 600
        while "LEADER: step 5" not in open(log).read():  # mid-generation
            assert leader.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
            time.sleep(0.5)
        follower.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = leader.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - killed_at < 60
        assert json.load(open(out))["error"] == "UNAVAILABLE"
    finally:
        for p in (leader, follower):
            p.kill()


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    """8 attention heads (tp=8 over both processes) and the test tokenizer."""
    import torch
    import transformers as tf

    from models.synthetic import make_test_tokenizer
    d = str(tmp_path_factory.mktemp("multihost_served") / "llama")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=2)).save_pretrained(d)
    make_test_tokenizer(d, vocab_size=512)
    return d


def test_grpc_server_across_two_processes(served_model, tmp_path):
    """`python -m serving.server --num_processes=2`: process 0 serves gRPC, process 1 follows; streams equal one
    process's; killing the follower gives the client UNAVAILABLE and the leader exits non-zero."""
    import grpc

    from serving.wire.client import Client, ClientError
    from serving.process import ServerProcess, cpu_xla_flags
    coord = _free_port()
    env = {"XLA_FLAGS": cpu_xla_flags(4)}
    secret = tmp_path / "step.secret"
    secret.write_text(SECRET)
    common = (f"--coordinator_address=127.0.0.1:{coord}", "--num_processes=2", "--tp=8", "--min_token_bucket=32",
              "--enable_prefix_caching=false", f"--step_channel_secret_file={secret}")
    leader = ServerProcess(served_model, str(tmp_path / "p0"), *common, "--process_id=0", env=env)
    follower = ServerProcess(served_model, str(tmp_path / "p1"), *common, "--process_id=1", env=env)
    try:
        leader.wait_ready(600)
        prompts = ["def main():", "import os\n", "hello world"]
        single = LLM(served_model, warmup=False, page_size=8, num_pages=512, max_num_seqs=32,
                     max_num_batched_tokens=32, min_token_bucket=32, enable_prefix_caching=False)
        expected = [o.token_ids for o in single.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))]
        with Client(leader.target) as client:
            got = [client.complete(p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
            assert got == expected
            stream = client.generate("a long one", max_tokens=400, temperature=0.0, ignore_eos=True)
            next(stream)
            follower.proc.send_signal(signal.SIGKILL)
            with pytest.raises(ClientError) as err:
                for _ in stream:
                    pass
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert leader.proc.wait(timeout=60) != 0
    finally:
        for p in (leader, follower):
            if p.proc.poll() is None:
                p.proc.kill()
