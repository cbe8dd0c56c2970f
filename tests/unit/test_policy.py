"""Policy pieces without a model: decisions, injection, the on-disk lineage, controls."""

from __future__ import annotations

import json
import os

import pytest

from aotx import wire
from aotx.device.errors import DeviceError
from aotx.device.memory import KEEP_GENERATIONS, Lineage, decide, inject
from aotx.device.policy import Policy

SRC = "User: My name is Alice and I live in Paris. I work as a nurse."


def test_decide_keeps_only_grounded_new_facts() -> None:
    assert decide("- Alice is a nurse who lives in Paris.", [], SRC) == \
        "Alice is a nurse who lives in Paris."
    assert decide("2) The user works as a nurse in Paris", [], SRC) == \
        "The user works as a nurse in Paris"
    assert decide("I'm Emily, a nurse who works in Paris.", [], SRC) is None  # invented name
    assert decide("Paris is the capital of France.", [], SRC) is None  # not about the user
    assert decide("NONE", [], SRC) is None
    assert decide("- ok", [], SRC) is None
    assert decide("Alice is a nurse who lives in Paris.", ["alice is a nurse who lives in paris."],
                  SRC) is None  # duplicate
    assert decide("Paris is the capital of France.", [],
                  "User: What is the capital of France?") is None  # no first-person statement
    # embellished: 2 of its 8 content words are the user's (a QA pass saw it kept)
    tennis = "User: My favourite sport is tennis and I play tennis every Sunday."
    assert decide("I'm a professional tennis coach, and I'm happy to share my passion for "
                  "the sport with others.", [], tennis) is None
    assert decide("The user's favourite sport is tennis, played every Sunday.", [], tennis) == \
        "The user's favourite sport is tennis, played every Sunday."


def test_inject_places_memory_before_the_template() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    out = inject(msgs, ["Alice lives in Paris."])
    assert out[0]["role"] == "system" and "- Alice lives in Paris." in out[0]["content"]
    assert out[1:] == msgs
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    out = inject(sys_msgs, ["X is y."])
    assert out[0]["content"].startswith("Be brief.\n\nKnown facts about the user:")
    assert len(out) == 2 and sys_msgs[0]["content"] == "Be brief."  # input not mutated
    assert inject(msgs, []) is msgs


def test_lineage_generations_are_atomic_checksummed_and_bounded(tmp_path) -> None:
    lin = Lineage(str(tmp_path), 7)
    assert lin.latest() == (0, [])
    for i in range(KEEP_GENERATIONS + 3):
        gen, written = lin.save([f"fact {i}"])
        assert gen == i + 1 and written > 0
    assert lin.latest() == (KEEP_GENERATIONS + 3, [f"fact {KEEP_GENERATIONS + 2}"])
    files = sorted(os.listdir(lin.dir))
    assert len(files) == KEEP_GENERATIONS
    assert all(oct(os.stat(os.path.join(lin.dir, f)).st_mode)[-3:] == "600" for f in files)
    # a torn newest file (bad checksum) and a partial temporary file are skipped
    newest = os.path.join(lin.dir, f"gen-{KEEP_GENERATIONS + 4:08d}.json")
    with open(newest, "w") as f:
        json.dump({"generation": KEEP_GENERATIONS + 4, "facts": ["torn"], "sha256": "00"}, f)
    with open(newest + ".tmp", "w") as f:
        f.write("{")
    assert lin.latest() == (KEEP_GENERATIONS + 3, [f"fact {KEEP_GENERATIONS + 2}"])
    assert lin.erase() >= KEEP_GENERATIONS
    assert os.listdir(lin.dir) == [] and lin.latest() == (0, [])


def test_controls_follow_the_revision() -> None:
    core = Policy(root="/nonexistent", enabled=True)
    A, S = wire.PolicyAction, wire.PolicyState

    def control(action: wire.PolicyAction, expected: int) -> int:
        try:
            core.control(action, expected)
        except DeviceError as exc:
            return exc.status
        return 200

    assert control(A.PAUSE, 0) == 409  # stale
    assert control(A.PAUSE, 1) == 200 and core.state is S.PAUSED
    assert core.status().reason is wire.PolicyReason.PAUSED
    assert control(A.RESUME, 2) == 200 and core.state is S.QUIET
    assert control(A.REVIEW_ON, 3) == 200 and core.review
    assert control(A.STOP, 4) == 200 and core.state is S.STOPPED
    assert core.status().control_revision == 5 and core.status().review_enabled == 1
    off = Policy(root="/nonexistent", enabled=False)
    assert off.state is S.OFF and off.status().reason is wire.PolicyReason.DISABLED
    with pytest.raises(DeviceError) as err:
        off.control(A.RESUME, 1)
    assert err.value.status == 409 and err.value.reason is wire.Reason.POLICY_OFF
    data = wire.encode_policy_status(core.status())
    assert len(data) == 160 and wire.decode_policy_status(data) == core.status()


def test_models_file_paths_cannot_escape_the_state_folder(tmp_path) -> None:
    import pytest

    from aotx.device.models import ModelConfigError, load_specs

    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    (state / "models" / "inside.gguf").write_bytes(b"GGUF")
    (state / "models" / "link.gguf").symlink_to(outside)
    for bad in ("../outside.gguf", "models/../../outside.gguf", "models/link.gguf"):
        (state / "models.toml").write_text(f'[default]\nenabled = false\n[[model]]\n'
                                           f'alias = "x"\npath = "{bad}"\n')
        with pytest.raises(ModelConfigError, match="leaves the state folder"):
            load_specs(str(state))
    (state / "models.toml").write_text('[default]\nenabled = false\n[[model]]\n'
                                       'alias = "x"\npath = "models/inside.gguf"\n')
    (spec,) = load_specs(str(state))
    assert spec.path == str((state / "models" / "inside.gguf").resolve()) and spec.role == 1


def test_models_file_poll_is_checked(tmp_path) -> None:
    import pytest

    from aotx.device.models import ModelConfigError, load_specs

    (tmp_path / "models.toml").write_text("[default]\npoll = 0\n")
    (spec,) = load_specs(str(tmp_path))
    assert spec.poll == 0
    (tmp_path / "models.toml").write_text("[default]\n")
    assert load_specs(str(tmp_path))[0].poll == 50
    for bad in ("101", "-2", '"fast"', "true"):
        (tmp_path / "models.toml").write_text(f"[default]\npoll = {bad}\n")
        with pytest.raises(ModelConfigError, match="poll must be"):
            load_specs(str(tmp_path))


def test_models_file_keys_it_does_not_read_are_refused(tmp_path) -> None:
    """A misspelt or misplaced key stops the device at start, naming it, instead of
    leaving the model as it was (a QA pass found each of these served as if absent)."""
    import pytest

    from aotx.device.models import ModelConfigError, load_specs

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = '[default]\nenabled = false\n[[model]]\nalias = "x"\npath = "m.gguf"\n'
    for text, why in (("[default]\nfoo = 1\n", r"\[default\]: unknown keys \['foo'\]"),
                      ('[default]\nsha256 = "' + "0" * 64 + '"\n', "unknown keys"),
                      ('[default]\npath = "m.gguf"\n', "unknown keys"),
                      ("[default.vllm]\nmax_model_len = 9\n", "unknown keys"),
                      (model + "slotz = 3\n", r"model 0: unknown keys \['slotz'\]"),
                      ('[default]\nenabled = "no"\n', "enabled is true or false"),
                      ("[default]\nthreads = -1\n", "threads must be"),
                      ('[default]\nthreads = "2"\n', "threads must be"),
                      (model + "threads = -3\n", "threads must be")):
        (tmp_path / "models.toml").write_text(text)
        with pytest.raises(ModelConfigError, match=why):
            load_specs(str(tmp_path))
    (tmp_path / "models.toml").write_text(model + "threads = 2\nsha256 = \"" + "a" * 64 + '"\n')
    (spec,) = load_specs(str(tmp_path))
    assert (spec.threads, spec.sha256) == (2, "a" * 64)


def test_models_file_kind_and_embedding_context(tmp_path) -> None:
    import pytest

    from aotx.device.models import ModelConfigError, load_specs

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "models.toml").write_text(
        '[default]\nembedding_context = 256\n[[model]]\nalias = "e"\npath = "m.gguf"\n'
        'kind = "embedding"\nslots = 6\n')
    chat, emb = load_specs(str(tmp_path))
    assert (chat.kind, chat.embedding_context, chat.slots) == ("chat", 256, 16)
    assert (emb.kind, emb.embedding_context, emb.slots) == ("embedding", 512, 1)  # no streams
    (tmp_path / "models.toml").write_text('[[model]]\nalias = "r"\npath = "m.gguf"\n'
                                          'kind = "rerank"\nslots = 4\n')
    assert [(s.kind, s.slots) for s in load_specs(str(tmp_path))][1] == ("rerank", 1)
    for bad, why in (('kind = "classify"', "kind must be"), ("embedding_context = 0", "positive"),
                     ('kind = "embedding"\nmmproj = "m.gguf"', "no projector"),
                     ('kind = "rerank"\nmmproj = "m.gguf"', "no projector"),
                     ('kind = "rerank"\nchat_template = "m.gguf"', "no chat_template"),
                     ('engine = "vllm"\n[model.vllm]\npooler_config = {}', "is for kind")):
        (tmp_path / "models.toml").write_text(
            f'[default]\nenabled = false\n[[model]]\nalias = "e"\npath = "m.gguf"\n{bad}\n')
        with pytest.raises(ModelConfigError, match=why):
            load_specs(str(tmp_path))
    (tmp_path / "rr").mkdir()  # a vLLM reranker: vLLM's pooling runner
    (tmp_path / "rr" / "config.json").write_text("{}")
    (tmp_path / "models.toml").write_text('[default]\nenabled = false\n[[model]]\nalias = "r"\n'
                                          'path = "rr"\nengine = "vllm"\nkind = "rerank"\n')
    (spec,) = load_specs(str(tmp_path))
    assert (spec.kind, spec.engine, dict(spec.vllm)) == ("rerank", "vllm", {"runner": "pooling"})


def test_forget_drops_a_principals_unprocessed_sources_and_its_running_extraction() -> None:
    """A memory erase: the principal's sources not yet processed are dropped, as are its
    pending facts, and an extraction running on one of its sources is marked to be
    discarded, so that nothing said before the erase is saved after it."""
    from aotx.device.memory import Pending, Source

    core = Policy(root="/nonexistent", enabled=True)
    core.log = [Source(1, 1, "done"), Source(1, 1, "running"), Source(2, 1, "b"),
                Source(1, 1, "later"), Source(2, 1, "c")]
    core.frontier = 1
    core.active = object()  # type: ignore[assignment]  # extracting log[1]
    core.pending = [Pending(1, 1, "fact"), Pending(2, 2, "other")]
    core.forget(1)
    assert [s.text for s in core.log] == ["done", "running", "b", "c"]
    assert core.discard_active and [p.principal for p in core.pending] == [2]
    core.discard_active, core.active = False, None
    core.forget(2)  # nothing running: every unprocessed source of 2 goes
    assert [s.text for s in core.log] == ["done", "running"]


def test_qualification_names_model_template_projector_and_source_profile() -> None:
    """The seed: the device checks the exact loaded model, wrapper, processors and source
    profile.  The qualified profile (SmolLM2 without a projector) passes; the same model
    and template with any projector, with another template, or another source profile
    (a changed extraction prompt) do not."""
    import hashlib

    from aotx.device import memory

    ((model, _template, projector, profile),) = memory.QUALIFIED_PROFILES
    assert projector == "" and profile == memory.source_profile()
    sha, src = bytes.fromhex(model), _qualified_template()
    assert memory.qualified(sha, src)
    assert not memory.qualified(sha, src, projector_sha256=bytes(32))  # a projector
    assert not memory.qualified(sha, src, projector_sha256=hashlib.sha256(b"x").digest())
    assert not memory.qualified(sha, src, profile="user-words/v1:0000000000000000")
    assert not memory.qualified(sha, "{{ messages }}")  # another wrapper
    assert not memory.qualified(bytes(32), src)  # another model file


def _qualified_template() -> str:
    """The embedded model's chat template, read from the GGUF's metadata (no llama.cpp)."""
    import gguf

    from aotx.device.models import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def test_models_file_kv_budget_type_and_chat_template(tmp_path) -> None:
    import pytest

    from aotx.device.models import KV_TYPES, ModelConfigError, load_specs
    from aotx.engine.llama.engine import KV_TYPES as ENGINE_KV_TYPES

    assert set(KV_TYPES) == set(ENGINE_KV_TYPES)
    for value, budget in (("268435456", 268435456), ('"256MiB"', 256 << 20),
                          ('"1.5GB"', 1_500_000_000), ('"auto"', -1)):
        (tmp_path / "models.toml").write_text(f"[default]\nkv_budget = {value}\n")
        assert load_specs(str(tmp_path))[0].kv_budget == budget
    (tmp_path / "models.toml").write_text('[default]\nkv_type = "q8_0"\n')
    (spec,) = load_specs(str(tmp_path))
    assert (spec.kv_type, spec.kv_budget) == ("q8_0", 0)  # no budget: a stream per sequence
    assert (spec.prompts_per_step, spec.kv_spill) == (1, -1)  # kv_spill "auto"
    for value, spill in (("0", 0), ('"64MiB"', 64 << 20), ('"auto"', -1)):
        (tmp_path / "models.toml").write_text(f"[default]\nkv_spill = {value}\n")
        assert load_specs(str(tmp_path))[0].kv_spill == spill
    (tmp_path / "models.toml").write_text("[default]\nprompts_per_step = 0\n")
    assert load_specs(str(tmp_path))[0].prompts_per_step == 0
    assert load_specs(str(tmp_path))[0].flash_attention  # on unless asked
    (tmp_path / "models.toml").write_text("[default]\nflash_attention = false\n")
    assert not load_specs(str(tmp_path))[0].flash_attention
    for bad, words in (('kv_budget = "lots"', "kv_budget is bytes"), ("kv_budget = 0", "kv_budget"),
                       ('kv_budget = "5 parsecs"', "kv_budget"), ('kv_type = "q4_0"', "kv_type"),
                       ('chat_template = "none.jinja"', "not a file"),
                       ("prompts_per_step = -1", "prompts_per_step"),
                       ("kv_spill = -5", "kv_spill is bytes"), ("kv_spill = true", "kv_spill"),
                       ('prompts_per_step = "all"', "prompts_per_step"),
                       ('flash_attention = "on"', "flash_attention is true or false")):
        (tmp_path / "models.toml").write_text(f"[default]\n{bad}\n")
        with pytest.raises(ModelConfigError, match=words):
            load_specs(str(tmp_path))
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "models.toml").write_text('[default]\nchat_template = "t.jinja"\n')
    assert load_specs(str(tmp_path))[0].chat_template == str((tmp_path / "t.jinja").resolve())


def test_the_pool_size_rule() -> None:
    from aotx.engine.llama.engine import MIN_POOL_CELLS, EngineConfig, pool_cells

    def cells(**kw: object) -> int:
        return pool_cells(EngineConfig(path="x", slots=16, slot_context=4096, **kw), 23040.0, 8192)  # type: ignore[arg-type]

    assert cells() == 16 * 4096  # streams: every sequence its whole context
    assert cells(unified=True) == 8192  # "auto": the training context
    assert cells(unified=True, kv_budget=100 * 23040) == MIN_POOL_CELLS
    assert cells(unified=True, kv_budget=1000 * 23040) == 1000
    assert cells(unified=True, kv_budget=1 << 40) == 16 * 4096  # never more than all contexts
