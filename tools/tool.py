"""The tool contract: argument models, results, and the base class every tool extends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from m3_agent.tools.junit import TestSummary

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment

ErrorKind = Literal["unknown_tool", "bad_json", "bad_args", "truncated", "execution", "timeout"]


class ToolResult(BaseModel):
    """What one tool call produced; `output` is the tool message the model reads."""

    output: str
    ok: bool
    error_kind: ErrorKind | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    tests: TestSummary | None = Field(None, description="set when the call ran tests: what they did")
    changed_files: list[str] = Field(default_factory=list)
    submitted: bool = False
    running: bool = False


class ToolCallError(Exception):
    """A mistake in a tool call the model can fix (bad path, string not found, ...).

    Tools raise it from `run`; `execute_call` turns it into a ToolResult with ok=False.
    """

    def __init__(self, message: str, *, kind: ErrorKind = "execution") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


class ToolArgs(BaseModel):
    """Base of every argument model: unknown keys are kept aside (reported, not fatal)."""

    model_config = ConfigDict(extra="ignore")


def clean_schema(schema: Any) -> Any:
    """Strip pydantic noise (titles, null branches of optional fields) from a JSON schema."""
    if isinstance(schema, list):
        return [clean_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key == "properties":
            out[key] = {name: clean_schema(prop) for name, prop in value.items()}
        else:
            out[key] = clean_schema(value)
    # Optional[X] shows as anyOf [X, null]: the model sees X, a null it sends is treated as absent.
    branches = out.get("anyOf")
    if isinstance(branches, list):
        non_null = [b for b in branches if b != {"type": "null"}]
        if len(non_null) == 1 and len(non_null) < len(branches):
            del out["anyOf"]
            out = {**non_null[0], **out}
    if "default" in out and out["default"] is None:
        del out["default"]
    return out


class Tool:
    """A tool the model can call: a name, a description, an argument model and an executor."""

    name: ClassVar[str]
    description: ClassVar[str]
    Args: ClassVar[type[ToolArgs]]

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        parameters = clean_schema(self.Args.model_json_schema())
        parameters.pop("description", None)  # the Args docstring: the tool description says it better
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    def run(self, args: Any, sandbox: Environment) -> ToolResult:
        """Execute validated `args` in `sandbox`; raise ToolCallError for mistakes the model can fix."""
        raise NotImplementedError
