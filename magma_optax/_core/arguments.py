"""A factory's arguments handed to the validating constructors that take them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any


def from_arguments(create: Callable[..., Any], arguments: Mapping[str, Any]) -> Any:
  """``create(**the entries of arguments that create takes)``.

  The factories take the engine's and the rule's arguments in one flat signature and
  hand them over with ``from_arguments(MaskConfig.create, locals())``, so that no
  argument list is written out twice (and none can be forgotten on the way).
  """
  names = inspect.signature(create).parameters
  return create(**{k: v for k, v in arguments.items() if k in names})
