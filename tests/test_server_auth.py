"""Admin token checks, adapter-source policy and the listen-address rule (no server needed)."""

from __future__ import annotations

import pytest

from adapter_cache.errors import InvalidArgumentError, LoraplexError, PermissionDeniedError, UnauthenticatedError
from adapter_cache.uri_policy import UriPolicy
from inference_service.frontend.auth import AdminAuth, is_loopback_listen


def test_no_token_configured_allows_everyone():
    AdminAuth(None).check([])


@pytest.mark.parametrize(
    "metadata, error",
    [
        ([], UnauthenticatedError),
        ([("authorization", "")], UnauthenticatedError),
        ([("authorization", "Basic s3cret")], UnauthenticatedError),
        ([("authorization", "Bearer wrong")], PermissionDeniedError),
        ([("authorization", "Bearer s3cre")], PermissionDeniedError),
    ],
)
def test_token_rejections(metadata, error):
    with pytest.raises(error):
        AdminAuth("s3cret").check(metadata)


def test_token_accepted():
    AdminAuth("s3cret").check([("user-agent", "x"), ("authorization", "Bearer s3cret")])
    AdminAuth("s3cret").check([("authorization", "bearer s3cret")])


def test_uri_policy_prefixes():
    p = UriPolicy(["file:///srv/adapters", "s3://bucket/team-a/"])
    assert p.check("file:///srv/adapters/x") == "file:///srv/adapters/x"
    assert p.check("file:///srv/adapters/./x//y") == "file:///srv/adapters/x/y"
    assert p.check("s3://bucket/team-a/m1") == "s3://bucket/team-a/m1"
    for bad in ("file:///srv/adapters-evil/x", "file:///etc/passwd", "s3://bucket/team-b/m",
                "http://example.com/a", "s3://bucket/team-a"):
        with pytest.raises(PermissionDeniedError):
            p.check(bad)


@pytest.mark.parametrize(
    "uri",
    ["file:///srv/adapters/../etc", "file:///srv/adapters/a/../../etc", "file:///srv/adapters/%2e%2e/etc",
     "s3://bucket/team-a/../team-b/x"],
)
def test_traversal_denied_with_and_without_allow_list(uri):
    for policy in (UriPolicy(["file:///srv/adapters", "s3://bucket/team-a/"]), UriPolicy()):
        with pytest.raises(PermissionDeniedError):
            policy.check(uri)


@pytest.mark.parametrize("uri, match", [
    ("", "is empty"),
    ("/srv/adapters/x", "has no scheme"),
    ("file://remotehost/srv/adapters/x", "must name a local path"),
    ("file:srv/adapters/x", "need an absolute path"),
    ("file:///srv/adapters/x\x00", "control characters"),
    ("s3://user:pw@bucket/team-a/x", "carries credentials"),
    ("s3://bucket/team-a/x#v2", "query or fragment"),
    ("ftp://bucket/team-a/x", "unsupported scheme"),
])
def test_malformed_uris_are_invalid(uri, match):
    """Each URI would be allowed by a prefix if it were read leniently (the path under the allowed
    directory, the key under the allowed prefix): INVALID_ARGUMENT for its own defect, not the
    PERMISSION_DENIED every URI gets from a policy that allows nothing."""
    policy = UriPolicy(["file:///srv/adapters", "s3://bucket/team-a/"])
    with pytest.raises(LoraplexError, match=match) as refused:
        policy.check(uri)
    assert type(refused.value) is InvalidArgumentError


def test_no_allow_list_allows_nothing_and_names_the_flag():
    """One policy for both processes: without prefixes every well-formed URI is refused, with a
    message naming the option that sets them."""
    with pytest.raises(PermissionDeniedError, match="--adapter-source-allow"):
        UriPolicy().check("s3://bucket/x/")
    with pytest.raises(PermissionDeniedError, match="--allow-prefix"):
        UriPolicy((), flag="--allow-prefix").check("file:///srv/adapters/x")


def test_a_symlink_out_of_an_allowed_directory_is_refused(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "adapters" / "escape").symlink_to(tmp_path / "secret")
    (tmp_path / "adapters" / "inside").mkdir()
    policy = UriPolicy([(tmp_path / "adapters").as_uri()])
    assert policy.check((tmp_path / "adapters" / "inside").as_uri()) == (tmp_path / "adapters" / "inside").as_uri()
    with pytest.raises(PermissionDeniedError):
        policy.check((tmp_path / "adapters" / "escape").as_uri())


@pytest.mark.parametrize("uri, error", [
    ("hf://org/model", InvalidArgumentError),  # no store fetches it
    ("s3://bucket/team-a/x?versionId=1", InvalidArgumentError),
    ("s3://bucket/team-a/./x", PermissionDeniedError),  # an object key cannot be normalised
])
def test_uris_no_store_would_fetch_as_named_are_refused(uri, error):
    for policy in (UriPolicy(["s3://bucket/team-a/"]), UriPolicy()):
        with pytest.raises(error):
            policy.check(uri)


def test_loopback_detection():
    for addr in ("127.0.0.1:50051", "localhost:1", "[::1]:5", "unix:///tmp/s.sock"):
        assert is_loopback_listen(addr), addr
    for addr in ("0.0.0.0:50051", "[::]:50051", "10.0.0.1:1", "example.com:443"):
        assert not is_loopback_listen(addr), addr
