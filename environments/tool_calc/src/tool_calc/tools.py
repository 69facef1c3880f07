"""The calculator's tools, an MCP server as verifiers documents (`vf.Toolset`, `@vf.tool` methods).

verifiers starts it with `python -m tool_calc.tools` beside the rollouts (one server for the taskset,
shared by every rollout: the tools keep no state) and hands its URL to the harness."""

from __future__ import annotations

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # offered as `add` and `multiply`, not `calc_toolset_add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Return a + b."""
        return a + b

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Return a * b."""
        return a * b


if __name__ == "__main__":
    CalcToolset.run()
