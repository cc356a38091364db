"""Chat templates stored in GGUF files, rendered as Hugging Face transformers renders them.

Sandboxed jinja2 with ``trim_blocks``, ``lstrip_blocks``, the loop-control extension, ``raise_exception``,
``bos_token``, ``eos_token``, ``tojson``, ``strftime_now`` and ``add_generation_prompt=True``. Shared by
every GGUF backend; knows strings only.
"""

from __future__ import annotations

import json
from datetime import datetime


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: The jinja source (``tokenizer.chat_template``), or ``None`` when the model has none.
        model_name: For error messages.
        bos_token: Text of the BOS token (``""`` if none).
        eos_token: Text of the EOS token.
    """

    def __init__(self, source: str | None, model_name: str, bos_token: str = "", eos_token: str = ""):
        self.model_name = model_name
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None if source is None else self._compile(source)

    def _compile(self, source: str):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        try:
            return env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.model_name} is invalid: {e}") from e

    def render(self, messages: list[dict[str, str]]) -> str:
        """The rendered conversation, ending with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template, or the template fails on the messages.
        """
        import jinja2

        if self._template is None:
            raise ValueError(f"model {self.model_name} has no chat template; pass chat=False (a plain completion prompt)")

        def raise_exception(message: str):
            raise ValueError(f"chat template of {self.model_name}: {message}")

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                eos_token=self.eos_token, raise_exception=raise_exception,
                strftime_now=lambda fmt: datetime.now().strftime(fmt),
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.model_name} failed: {e}") from e
