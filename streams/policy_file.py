"""Where the worker's rule policy comes from: a file named by the environment, or the defaults.

The rules parse a policy from text and do no I/O (:mod:`gpusteward.rules.policy`);
reading the file and the environment happens here, at the edge of the
worker, and in the CLI, which uses these same functions. With no file named,
the policy is every rule's defaults: exactly what the shipped
``rules/policy.yaml`` says (a test keeps the two equal), so nothing is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gpusteward.configfile import read_text
from gpusteward.rules.policy import Policy, PolicyError, parse_policy

POLICY_ENV = "GPUSTEWARD_POLICY_FILE"


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """The policy in ``path``, or the defaults when ``path`` is None."""
    if path is None:
        return Policy()
    text = read_text(path, PolicyError)
    return parse_policy(text, str(path))


def policy_from_env(environ: Mapping[str, str] | None = None) -> Policy:
    """The policy named by ``GPUSTEWARD_POLICY_FILE``, or the defaults when it is unset."""
    environ = os.environ if environ is None else environ
    return load_policy(environ.get(POLICY_ENV) or None)
