"""LoRA adapters through a real server: a request names its adapter as `model` and gets what `peft`'s own model
gives, token for token, in a batch that mixes adapters and the base model; more adapters than device slots
all answer; an adapter unloaded while in use lets its running requests finish; a tenant without rights to an
adapter gets the 404 of an unknown model; bad folders are errors naming the file; the prefix cache never
shares KV between adapters."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from config.settings import SettingsError
from contract.plan import BASE_MODEL_SLOT, StepPlan, StepResult
from gpu.lora import ADAPTER_CONFIG
from gpu.models import load_model
from gpu.runner import ModelRunner
from tests.app.conftest import TINY, ServerThread, tiny_context
from tests.gpu.reference import byte_prompt, hf_greedy
from tests.gpu.test_lora import save_adapter
from tests.tenants_files import tenants_toml

ADMIN_KEY, ALICE_KEY, BOB_KEY = "fl-admin-key", "fl-alice-key", "fl-bob-key"
LORA_SETTINGS: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


class Adapters:
    """Adapters saved by peft on builtin:tiny (random A and B, fixed seeds), and their peft models as references."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peft_models: dict[str, Any] = {}
        for name, seed, rank in (("one", 1, 4), ("two", 2, 8), ("three", 3, 8)):
            model = save_adapter(root / name, seed, rank)
            model.generation_config.eos_token_id = None  # runs to max_tokens, as the server does with ignore_eos
            self.peft_models[name] = model
        self.base = load_model(TINY, device="cpu", dtype="float32").model
        self.base.generation_config.eos_token_id = None

    def path(self, name: str) -> str:
        return str(self.root / name)

    def module(self, name: str) -> str:
        return f"{name}={self.path(name)}"

    def expected(self, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        reference = self.peft_models.get(model, self.base)
        return hf_greedy(reference, prompt, max_tokens)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(tmp_path_factory.mktemp("lora"))


@pytest.fixture
def start_lora_server() -> Iterator[Callable[..., ServerThread]]:
    """A builtin:tiny server with LoRA on its own model instance (adapters wrap the model's layers)."""
    started: list[ServerThread] = []

    def start(**overrides: Any) -> ServerThread:
        loaded = load_model(TINY, device="cpu", dtype="float32")
        server = ServerThread(tiny_context(loaded, **{**LORA_SETTINGS, **overrides})).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def runner_of(server: ServerThread) -> ModelRunner:
    runner = server.context.engine.executor
    assert isinstance(runner, ModelRunner)
    return runner


def record_plans(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[StepPlan]:
    runner = runner_of(server)
    plans: list[StepPlan] = []
    execute = runner.execute

    def recorded(plan: StepPlan) -> StepResult:
        plans.append(plan)
        return execute(plan)

    monkeypatch.setattr(runner, "execute", recorded)
    return plans


def complete(server: ServerThread, model: str, prompt: list[int], max_tokens: int, key: str | None = None,
             **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=payload, headers=headers, timeout=60)


def output_tokens(server: ServerThread, response: httpx.Response) -> list[int]:
    """The tokens the engine generated for a completion (the recording engine keeps its requests)."""
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    request = next(r for r in server.engine.submitted if r.request_id == request_id)
    return list(request.output_token_ids)


def test_adapters_mixed_in_one_batch_give_what_peft_gives_alone(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_lora_server(lora_modules=(adapters.module("one"), adapters.module("two")))
    plans = record_plans(server, monkeypatch)
    cases = [(model, byte_prompt(12 + 7 * i, offset=5 * i), 10)
             for i, model in enumerate(["one", "two", server.model_name, "two", "one", server.model_name])]
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda case: complete(server, *case), cases))

    for (model, prompt, max_tokens), response in zip(cases, responses, strict=True):
        assert response.json()["model"] == model
        assert output_tokens(server, response) == adapters.expected(model, prompt, max_tokens), model
    assert any({seq.lora_slot for seq in plan.sequences} == {0, 1, BASE_MODEL_SLOT} for plan in plans)


def test_more_adapters_than_slots_used_in_turn_all_answer(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread]) -> None:
    server = start_lora_server(lora_modules=tuple(adapters.module(n) for n in ("one", "two", "three")),
                               max_cpu_loras=2)
    prompt = byte_prompt(20)
    for model in ["one", "two", "three", "one", "three", "two"]:
        assert output_tokens(server, complete(server, model, prompt, 6)) == adapters.expected(model, prompt, 6)


def test_an_adapter_folder_broken_after_its_check_ends_only_its_own_requests(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    """One slot and one adapter kept read: using `two` drops `one` from memory, so `one` is read again from
    its folder, which is gone by then. Its request ends with an error naming the file; a base request in
    the same steps, and `one` once its folder is back, are served as before."""
    shutil.copytree(adapters.root / "one", tmp_path / "one")
    server = start_lora_server(lora_modules=(f"one={tmp_path / 'one'}", adapters.module("two")),
                               max_loras=1, max_cpu_loras=1)
    prompt = byte_prompt(20)
    assert output_tokens(server, complete(server, "two", prompt, 4)) == adapters.expected("two", prompt, 4)
    shutil.move(tmp_path / "one", tmp_path / "moved")
    with ThreadPoolExecutor(2) as pool:
        broken, base = pool.map(lambda model: complete(server, model, prompt, 6), ["one", server.model_name])
    assert broken.status_code == 500
    assert "could not be loaded" in broken.text and ADAPTER_CONFIG in broken.text
    assert output_tokens(server, base) == adapters.expected(server.model_name, prompt, 6)
    shutil.move(tmp_path / "moved", tmp_path / "one")
    assert output_tokens(server, complete(server, "one", prompt, 6)) == adapters.expected("one", prompt, 6)
    assert server.context.engine.health().is_healthy


def test_the_responses_and_messages_apis_take_adapter_names(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread]) -> None:
    server = start_lora_server(lora_modules=(adapters.module("one"),))
    for path, body in (("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})):
        response = httpx.post(server.base_url + path, json={"model": "one", **body}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "one"
        assert server.engine.submitted[-1].adapter is not None and server.engine.submitted[-1].adapter.name == "one"
        unknown = httpx.post(server.base_url + path, json={"model": "nine", **body}, timeout=60)
        assert unknown.status_code == 404


def test_unloading_an_adapter_in_use_lets_its_running_request_finish(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_lora_server(lora_modules=(adapters.module("two"),))
    runner = runner_of(server)
    steps_allowed = threading.Event()
    steps_allowed.set()
    first_step_done = threading.Event()
    execute = runner.execute

    def gated(plan: StepPlan) -> StepResult:
        steps_allowed.wait(timeout=30)
        result = execute(plan)
        first_step_done.set()
        steps_allowed.clear()  # the request is now running: hold the next step until the unload is done
        return result

    monkeypatch.setattr(runner, "execute", gated)
    prompt = byte_prompt(16)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, server, "two", prompt, 12)
        assert first_step_done.wait(timeout=30)
        unloaded = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "two"}, timeout=30)
        assert unloaded.status_code == 200, unloaded.text
        refused = complete(server, "two", prompt, 4)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        assert not running.done()
        monkeypatch.setattr(runner, "execute", execute)
        steps_allowed.set()
        finished = running.result(timeout=60)
    assert output_tokens(server, finished) == adapters.expected("two", prompt, 12)
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [server.model_name]


def test_a_tenant_without_rights_gets_the_404_of_an_unknown_model(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(tenants_toml({"alice": ALICE_KEY, "bob": BOB_KEY}, admin_key=ADMIN_KEY)
                            + f'\n[[adapters]]\nname = "one"\npath = "{adapters.path("one")}"\ntenants = ["alice"]\n')
    server = start_lora_server(tenants_file=str(tenants_file))

    def listed(key: str) -> dict[str, Any]:
        response = httpx.get(f"{server.base_url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
        return {m["id"]: m for m in response.json()["data"]}

    assert listed(ALICE_KEY)["one"]["parent"] == server.model_name
    assert set(listed(BOB_KEY)) == {server.model_name}
    prompt = byte_prompt(10)
    assert output_tokens(server, complete(server, "one", prompt, 4, ALICE_KEY)) == adapters.expected("one", prompt, 4)
    refused, unknown = complete(server, "one", prompt, 4, BOB_KEY), complete(server, "nope", prompt, 4, BOB_KEY)
    assert refused.status_code == unknown.status_code == 404
    assert refused.json()["error"] == {**unknown.json()["error"], "message": unknown.json()["error"]["message"]
                                       .replace("'nope'", "'one'")}
    # paths that answered before the model was looked at with the tenant's rights: the same 404 for both
    probes: dict[str, dict[str, Any]] = {"/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"prompt": [10**6], "max_tokens": 1},  # a token id out of range
              "/v1/responses": {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                   "schema": {"type": "nonsense"}}}}}
    for path, payload in probes.items():
        answers = [httpx.post(f"{server.base_url}{path}", json={"model": model, **payload}, timeout=30,
                              headers={"authorization": f"Bearer {BOB_KEY}"}).status_code for model in ("one", "nope")]
        assert answers == [404, 404], path
    retrieved = httpx.get(f"{server.base_url}/v1/models/one", headers={"authorization": f"Bearer {BOB_KEY}"},
                          timeout=30)
    assert retrieved.status_code == 404
    # the operator endpoints take the admin key, not a tenant's
    load = {"lora_name": "two", "lora_path": adapters.path("two")}
    as_tenant = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=load,
                           headers={"authorization": f"Bearer {ALICE_KEY}"}, timeout=30)
    assert as_tenant.status_code == 403 and as_tenant.json()["error"]["code"] == "admin_key_required"
    as_admin = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=load,
                          headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert as_admin.status_code == 200, as_admin.text
    assert "two" in listed(BOB_KEY)  # loaded at runtime: every tenant may use it
    # reloading alice's adapter keeps it hers: a reload is no way to make it everyone's
    reload = {"lora_name": "one", "lora_path": adapters.path("one")}
    reloaded = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=reload,
                          headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert reloaded.status_code == 200, reloaded.text
    assert "one" in listed(ALICE_KEY) and "one" not in listed(BOB_KEY)
    assert complete(server, "one", prompt, 4, BOB_KEY).status_code == 404


def test_a_bad_adapter_folder_at_start_is_an_error_naming_the_file(adapters: Adapters, tmp_path: Path) -> None:
    loaded = load_model(TINY, device="cpu", dtype="float32")
    with pytest.raises(SettingsError, match=f"{tmp_path / 'missing' / ADAPTER_CONFIG} is missing"):
        tiny_context(loaded, **LORA_SETTINGS, lora_modules=(f"bad={tmp_path / 'missing'}",))
    with pytest.raises(SettingsError, match="r=8 is over max_lora_rank=4"):
        tiny_context(loaded, **{**LORA_SETTINGS, "max_lora_rank": 4}, lora_modules=(adapters.module("two"),))


def test_a_bad_folder_through_the_load_endpoint_is_a_400_and_serving_goes_on(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    server = start_lora_server(lora_modules=(adapters.module("one"),))
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / ADAPTER_CONFIG).write_text("{not json")
    response = httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                          json={"lora_name": "torn", "lora_path": str(tmp_path / "torn")}, timeout=30)
    assert response.status_code == 400
    assert str(tmp_path / "torn") in response.json()["error"]["message"]
    assert complete(server, "torn", byte_prompt(8), 2).status_code == 404
    prompt = byte_prompt(9)
    assert output_tokens(server, complete(server, "one", prompt, 4)) == adapters.expected("one", prompt, 4)


def cached_tokens(server: ServerThread, model: str, prompt: list[int]) -> int:
    response = complete(server, model, prompt, 2)
    assert response.status_code == 200, response.text
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_the_prefix_cache_never_shares_kv_between_adapters(
        adapters: Adapters, start_lora_server: Callable[..., ServerThread]) -> None:
    server = start_lora_server(lora_modules=(adapters.module("one"), adapters.module("two")))
    prompt = byte_prompt(70)  # four full blocks of 16 tokens
    assert cached_tokens(server, "one", prompt) == 0
    assert cached_tokens(server, "one", prompt) == 64
    assert cached_tokens(server, "two", prompt) == 0  # cached a second time, under its own adapter
    assert cached_tokens(server, "two", prompt) == 64
    assert cached_tokens(server, server.model_name, prompt) == 0
    assert output_tokens(server, complete(server, "two", prompt, 5)) == adapters.expected("two", prompt, 5)


def test_the_load_endpoint_of_a_server_without_lora_says_so(instant_server: ServerThread) -> None:
    response = httpx.post(f"{instant_server.base_url}/v1/load_lora_adapter",
                          json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "lora_not_enabled"
    assert instant_server.context.adapters is None


def test_an_adapter_named_twice_at_start_is_an_error(adapters: Adapters) -> None:
    loaded = load_model(TINY, device="cpu", dtype="float32")
    with pytest.raises(SettingsError, match="'one' is named twice"):
        tiny_context(loaded, **LORA_SETTINGS, lora_modules=(adapters.module("one"), f"one={adapters.path('two')}"))
