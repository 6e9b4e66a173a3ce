"""Command and manifest templates with ``{placeholder}`` fields the controller fills in.

Only the names in ``PLACEHOLDERS`` are replaced; any other ``{...}`` is left as it is, so
shell snippets and JSON in a template keep their braces (``${HOME}`` is never touched). A
``{name}`` that looks like a misspelt placeholder is refused when the template is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sglang_elastic_ep.core.controller import JoinerSpec

PLACEHOLDERS: Mapping[str, str] = MappingProxyType({
    "rank_offset": "first EP rank of the joiner (--elastic-ep-join-rank-offset)",
    "num_ranks": "EP ranks in the joiner (its --tp/--ep/--dp size)",
    "join_mode": "scale (a new rank) or recover (a failed one's replacement)",
    "dist_init_addr": "the deployment's --dist-init-addr (host:port of node 0)",
    "port": "HTTP port for the joiner's own server",
    "operation_id": "the scale operation it joins, or the recovery attempt's id",
    "ep_size": "EP size the joiner joins into",
    "deployment": "the controller's --deployment name",
})
_FIELD = re.compile(r"(?<![$\w{]){([a-z_][a-z0-9_]*)}(?!})")


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Template:
    text: str
    source: str = "template"  # for messages: a flag or file name

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise TemplateError(f"{self.source} is empty")
        unknown = sorted(set(_FIELD.findall(self.text)) - set(PLACEHOLDERS))
        if unknown:
            raise TemplateError(
                f"{self.source} has unknown placeholder(s) "
                f"{', '.join('{' + u + '}' for u in unknown)}; known: "
                f"{', '.join('{' + k + '}' for k in PLACEHOLDERS)}"
            )

    @property
    def placeholders(self) -> frozenset[str]:
        return frozenset(name for name in PLACEHOLDERS if "{" + name + "}" in self.text)

    def render_joiner(self, spec: JoinerSpec, *, port: int, dist_init_addr: str | None,
                      deployment: str) -> str:
        """This template filled in for the joiner ``spec``."""
        return self.render({
            "rank_offset": spec.rank_offset,
            "num_ranks": spec.num_ranks,
            "join_mode": spec.mode.value,
            "dist_init_addr": dist_init_addr,
            "port": port,
            "operation_id": spec.operation_id,
            "ep_size": spec.ep_size,
            "deployment": deployment,
        })

    def render(self, values: Mapping[str, object]) -> str:
        missing = sorted(
            name for name in self.placeholders if values.get(name) in (None, "")
        )
        if missing:
            raise TemplateError(
                f"{self.source} uses {', '.join('{' + m + '}' for m in missing)} but no value "
                f"was given (e.g. --dist-init-addr for {{dist_init_addr}})"
            )
        text = self.text
        for name in self.placeholders:
            text = text.replace("{" + name + "}", str(values[name]))
        return text
