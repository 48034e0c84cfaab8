"""The tenants file, key authentication and adding a tenant."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenancy.tenants import (
    DEFAULT_TENANT,
    Tenant,
    TenantId,
    TenantLimits,
    TenantRegistry,
    TenantsFileError,
    append_tenant,
    hash_api_key,
    load_tenants,
)

ALICE_KEY = "fl-alice-key"
BOB_KEY = "fl-bob-key"
GOOD_HASH = hash_api_key(ALICE_KEY)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_load_tenants_reads_every_field(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
[[tenants]]
id = "alice"
weight = 2
api_key_hashes = ["{GOOD_HASH}"]
classes = ["interactive"]
max_concurrent = 4
max_queued = 16
tokens_per_minute = 100000
max_prompt_tokens = 2048
cache_group = "shared-docs"

[[tenants]]
id = "bob"
""")
    registry = load_tenants(path)
    assert registry.requires_auth
    alice = registry.get("alice")
    assert alice == Tenant(TenantId("alice"), 2.0, (GOOD_HASH,), frozenset({"interactive"}),
                           TenantLimits(4, 16, 100000, 2048), "shared-docs")
    assert alice.cache_salt_for() == Tenant(TenantId("zed"), cache_group="shared-docs").cache_salt_for()
    bob = registry.get("bob")
    assert bob.weight == 1.0 and bob.api_key_hashes == () and bob.classes == frozenset({"interactive", "batch"})
    assert bob.limits == TenantLimits() and bob.cache_salt_for() != alice.cache_salt_for()
    assert [t.tenant_id for t in registry] == ["alice", "bob"]
    assert registry.weight("alice") == 2.0
    assert registry.get("stranger").weight == 1.0  # ids not in the file: an unlimited weight-1 stand-in


@pytest.mark.parametrize(("entry", "message"), [
    ('id = "a"\nweight = 0', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got 0"),
    ('id = "a"\nweight = -1.5', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got -1.5"),
    ('id = "a"\nweight = "heavy"', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got 'heavy'"),
    ('id = "a"\nweight = true', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got True"),
    ('id = "a"\nweight = inf', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got inf"),
    ('id = "a"\nweight = nan', "tenants[0] (id 'a'): 'weight' must be a finite number > 0, got nan"),
    ('id = "a"\nwieght = 2', "tenants[0]: unknown field 'wieght'"),
    ('id = "a"\napi_key_hashes = ["sha256:abc"]', "tenants[0] (id 'a'): 'api_key_hashes' entry 'sha256:abc'"),
    (f'id = "a"\napi_key_hashes = ["{GOOD_HASH.upper()}"]', "tenants[0] (id 'a'): 'api_key_hashes' entry"),
    (f'id = "a"\napi_key_hashes = ["{GOOD_HASH.removeprefix("sha256:")}"]', "'api_key_hashes' entry"),
    ('id = "a"\napi_key_hashes = "sha256:00"', "tenants[0] (id 'a'): 'api_key_hashes' must be a list"),
    ('id = "a"\nclasses = ["realtime"]', "tenants[0] (id 'a'): 'classes' must be a non-empty list"),
    ('id = "a"\nclasses = []', "tenants[0] (id 'a'): 'classes' must be a non-empty list"),
    ('id = "a"\nclasses = "batch"', "tenants[0] (id 'a'): 'classes' must be a non-empty list"),
    ('id = "a"\nmax_concurrent = 0', "tenants[0] (id 'a'): 'max_concurrent' must be a positive integer, got 0"),
    ('id = "a"\ntokens_per_minute = 1.5', "tenants[0] (id 'a'): 'tokens_per_minute' must be a positive integer"),
    ('id = ""', "tenants[0]: 'id' must be a non-empty string"),
    ("weight = 1", "tenants[0]: 'id' must be a non-empty string"),
    ('id = "a"\ncache_group = ""', "tenants[0] (id 'a'): 'cache_group' must be a non-empty string"),
])
def test_malformed_entry_names_the_entry_and_the_field(tmp_path: Path, entry: str, message: str) -> None:
    path = write(tmp_path, f"[[tenants]]\n{entry}\n")
    with pytest.raises(TenantsFileError) as caught:
        load_tenants(path)
    assert message in str(caught.value)


def test_the_entry_is_named_by_its_position(tmp_path: Path) -> None:
    path = write(tmp_path, '[[tenants]]\nid = "a"\n\n[[tenants]]\nid = "b"\nweight = 0\n')
    with pytest.raises(TenantsFileError, match=r"^tenants\[1\] \(id 'b'\): 'weight'"):
        load_tenants(path)


def test_duplicate_id_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, '[[tenants]]\nid = "a"\n\n[[tenants]]\nid = "b"\n\n[[tenants]]\nid = "a"\nweight = 3\n')
    with pytest.raises(TenantsFileError, match=r"tenants\[2\]: 'id' 'a' appears twice"):
        load_tenants(path)


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected one or more [[tenants]] entries"),
    ("tenants = 3", "expected one or more [[tenants]] entries"),
    ("[[tenants]\nid = 1", "is not valid TOML"),
])
def test_file_level_problems(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TenantsFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_tenants(write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="tenants file not found"):
        load_tenants(tmp_path / "nowhere.toml")


# ---- authentication --------------------------------------------------------------------------


def two_tenants(alice_hashes: tuple[str, ...] = (GOOD_HASH,)) -> TenantRegistry:
    return TenantRegistry([Tenant(TenantId("alice"), api_key_hashes=alice_hashes),
                           Tenant(TenantId("bob"), api_key_hashes=(hash_api_key(BOB_KEY),))], requires_auth=True)


def test_authenticate_finds_the_owner_of_a_key() -> None:
    registry = two_tenants()
    alice, bob = registry.authenticate(ALICE_KEY), registry.authenticate(BOB_KEY)
    assert alice is not None and alice.tenant_id == "alice"
    assert bob is not None and bob.tenant_id == "bob"


def test_authenticate_rejects_a_wrong_or_missing_key() -> None:
    registry = two_tenants()
    assert registry.authenticate("fl-not-a-key") is None
    assert registry.authenticate(ALICE_KEY + "x") is None
    assert registry.authenticate(GOOD_HASH) is None  # the stored hash is not itself a key
    assert registry.authenticate(None) is None
    assert registry.authenticate("") is None


def test_a_revoked_key_stops_working_and_the_others_do_not() -> None:
    """Revoking a key is removing its hash from the file."""
    second_key = "fl-alice-second"
    before = two_tenants((GOOD_HASH, hash_api_key(second_key)))
    assert before.authenticate(ALICE_KEY) is not None
    after = two_tenants((hash_api_key(second_key),))
    assert after.authenticate(ALICE_KEY) is None
    revived = after.authenticate(second_key)
    assert revived is not None and revived.tenant_id == "alice"
    assert after.authenticate(BOB_KEY) is not None


def test_without_auth_everyone_is_the_default_tenant() -> None:
    registry = TenantRegistry.single_default()
    for key in (None, "", "anything"):
        tenant = registry.authenticate(key)
        assert tenant is not None and tenant.tenant_id == DEFAULT_TENANT


# ---- append_tenant ---------------------------------------------------------------------------


def test_append_tenant_creates_the_file_and_stores_only_the_hash(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    key = append_tenant(path, "alice", 2.5)
    text = path.read_text(encoding="utf-8")
    assert key.startswith("fl-") and key not in text
    assert hash_api_key(key) in text
    registry = load_tenants(path)
    tenant = registry.authenticate(key)
    assert tenant is not None and tenant.tenant_id == "alice" and tenant.weight == 2.5


def test_append_tenant_keeps_the_existing_entries(tmp_path: Path) -> None:
    path = write(tmp_path, f'[[tenants]]\nid = "alice"\nweight = 3\napi_key_hashes = ["{GOOD_HASH}"]\n')
    key = append_tenant(path, "bob", 1)
    registry = load_tenants(path)
    assert [t.tenant_id for t in registry] == ["alice", "bob"]
    alice, bob = registry.authenticate(ALICE_KEY), registry.authenticate(key)
    assert alice is not None and alice.weight == 3.0
    assert bob is not None and bob.tenant_id == "bob"
    assert key != append_tenant(path, "carol", 1)  # every key is fresh


def test_append_tenant_refuses_a_duplicate_or_a_bad_weight(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    append_tenant(path, "alice", 1)
    before = path.read_text(encoding="utf-8")
    with pytest.raises(TenantsFileError, match="tenant 'alice' already exists"):
        append_tenant(path, "alice", 2)
    for weight in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(TenantsFileError, match="weight must be a finite number > 0"):
            append_tenant(path, "bob", weight)
    assert path.read_text(encoding="utf-8") == before


@pytest.mark.parametrize("tenant_id", ["", 'evil"\nweight = 100', "a b", "x" * 65, "über"])
def test_append_tenant_refuses_an_id_that_is_not_plain(tmp_path: Path, tenant_id: str) -> None:
    """The id goes into the file as written, so it must not be able to break out of its string."""
    path = tmp_path / "tenants.toml"
    append_tenant(path, "alice", 1)
    before = path.read_text(encoding="utf-8")
    with pytest.raises(TenantsFileError, match="must be 1-64 letters, digits"):
        append_tenant(path, tenant_id, 1)
    assert path.read_text(encoding="utf-8") == before


def test_append_tenant_refuses_to_extend_a_broken_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[[tenants]]\nid = "alice"\nweight = -1\n')
    with pytest.raises(TenantsFileError, match="'weight'"):
        append_tenant(path, "bob", 1)
    assert "bob" not in path.read_text(encoding="utf-8")


def test_cache_salts_cannot_be_forged_by_tenant_ids_or_request_salts() -> None:
    plain = Tenant(TenantId("a")).cache_salt_for("b")
    forged = Tenant(TenantId("a|request:b")).cache_salt_for(None)
    forged_json = Tenant(TenantId('a","b')).cache_salt_for(None)
    group = Tenant(TenantId("x"), cache_group="team")

    assert len({plain, forged, forged_json, Tenant(TenantId("a")).cache_salt_for(None)}) == 4
    assert group.cache_salt_for() == Tenant(TenantId("y"), cache_group="team").cache_salt_for()
    assert group.cache_salt_for() != Tenant(TenantId("team")).cache_salt_for()
    assert group.cache_salt_for("s") != group.cache_salt_for()


def test_the_admin_table_holds_operator_keys(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[admin]\napi_key_hashes = ["{hash_api_key("root-key")}"]\n\n'
                    f'[[tenants]]\nid = "a"\napi_key_hashes = ["{hash_api_key("a-key")}"]\n')
    registry = load_tenants(path)

    assert registry.is_admin("root-key")
    assert not registry.is_admin("a-key") and not registry.is_admin(None) and not registry.is_admin("")
    assert TenantRegistry.single_default().is_admin(None)  # no tenants file: nothing is closed
    path.write_text('[admin]\nkeys = ["x"]\n\n[[tenants]]\nid = "a"\n')
    with pytest.raises(TenantsFileError, match="admin"):
        load_tenants(path)


def test_adapters_of_the_tenants_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nid = "acme"\n\n[[adapters]]\nname = "support"\npath = "/a/support"\n'
                    'tenants = ["acme"]\n\n[[adapters]]\nname = "open"\npath = "/a/open"\n')
    adapters = load_tenants(path).adapters
    assert [(a.name, a.path, a.tenants) for a in adapters] == [("support", "/a/support", ("acme",)),
                                                                ("open", "/a/open", None)]
    path.write_text('[[tenants]]\nid = "acme"\n\n[[adapters]]\nname = "x"\n')
    with pytest.raises(TenantsFileError, match=r"adapters\[0\]: 'path'"):
        load_tenants(path)


@pytest.mark.parametrize(("admin", "holder"), [(False, "tenant 'a'"), (True, "the admin")])
def test_a_key_hash_listed_twice_is_rejected(tmp_path: Path, admin: bool, holder: str) -> None:
    key_hash = hash_api_key("shared-key")
    head = f'[admin]\napi_key_hashes = ["{key_hash}"]\n\n' if admin else ""
    first = '[[tenants]]\nid = "a"\n' + ("" if admin else f'api_key_hashes = ["{key_hash}"]\n')
    path = write(tmp_path, f'{head}{first}\n[[tenants]]\nid = "b"\napi_key_hashes = ["{key_hash}"]\n')
    with pytest.raises(TenantsFileError, match=rf"tenants\[1\] \('b'\): a key hash it lists is also {holder}'s"):
        load_tenants(path)
