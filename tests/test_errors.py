"""The error hierarchy: API statuses map to permanent or temporary errors with a delay."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpusteward import errors
from gpusteward.errors import (
    ApiTimeout,
    ConfigError,
    Conflict,
    GpustewardError,
    Invalid,
    NotFound,
    PermanentError,
    ServerError,
    TemporaryError,
    TooManyRequests,
    api_error,
    shown_url,
    without_url,
)

STATUS = b'{"kind":"Status","status":"Failure","reason":"%s","message":"%s","code":%d}'


@pytest.mark.parametrize(("status", "kind"), [(404, NotFound), (409, Conflict),
                                              (422, Invalid)])
def test_client_errors_are_permanent(status: int, kind: type) -> None:
    error = api_error(status, STATUS % (b"R", b"no", status))
    assert type(error) is kind
    assert isinstance(error, PermanentError) and not isinstance(error, TemporaryError)
    assert (error.status, error.reason, error.message) == (status, "R", "no")
    assert isinstance(api_error(403, b"forbidden"), PermanentError)


def test_429_and_5xx_are_temporary_and_honour_retry_after() -> None:
    throttled = api_error(429, STATUS % (b"TooManyRequests", b"slow down", 429),
                          retry_after_header="7")
    assert isinstance(throttled, TooManyRequests) and throttled.delay == 7.0
    for status in (500, 502, 503, 504):
        error = api_error(status, b"<html>bad gateway</html>")
        assert isinstance(error, ServerError) and isinstance(error, TemporaryError)
        assert error.delay == errors.DEFAULT_RETRY_DELAY_S
        assert error.message == "<html>bad gateway</html>"  # not a Status: the body, cut
    assert isinstance(ApiTimeout(0, "Timeout", "read timed out"), TemporaryError)


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
    assert errors.retry_after("3", now) == 3.0
    assert errors.retry_after("Mon, 23 Nov 2026 12:00:30 GMT", now) == 30.0
    assert errors.retry_after("Mon, 23 Nov 2026 11:00:00 GMT", now) == 0.0
    assert errors.retry_after("soon", now) is None
    assert errors.retry_after(None, now) is None


def test_long_bodies_are_cut_to_one_line() -> None:
    body = ("line\n" * 200).encode()
    error = api_error(422, body)
    assert len(str(error)) < errors.MAX_DETAIL + 60
    assert "\n" not in str(error) and "more characters" in str(error)


def test_existing_errors_sit_under_the_root_and_keep_their_old_bases() -> None:
    from gpusteward.collectors.source import SourceError
    from gpusteward.rules import UnknownRuleError
    from gpusteward.rules.policy import PolicyError

    assert issubclass(PolicyError, ConfigError) and issubclass(PolicyError, ValueError)
    assert issubclass(UnknownRuleError, PermanentError) and issubclass(UnknownRuleError, KeyError)
    assert issubclass(SourceError, TemporaryError)
    assert issubclass(ConfigError, GpustewardError)


def test_a_url_is_shown_without_what_makes_it_a_credential() -> None:
    slack = "https://hooks.slack.com/services/T0/B0/s3cr3t"
    assert shown_url(slack) == "https://hooks.slack.com/…"
    assert shown_url("http://admin:pw@am.monitoring:9093") == "http://am.monitoring:9093"
    assert shown_url("http://admin:pw@am:9093/prefix?token=t", keep_path=True) == (
        "http://am:9093/prefix/…")
    assert shown_url("http://[::1]:8080/x") == "http://[::1]:8080/…"
    for unreadable in ("hooks.slack.com/services/T0/B0/s3cr3t", "http://h:port/", ""):
        assert shown_url(unreadable) == "<unreadable URL>"
    assert without_url(f"POST {slack} failed", slack) == (
        "POST https://hooks.slack.com/… failed")
