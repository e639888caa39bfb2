"""Request bodies in OpenAI's shapes, plus hypic's extensions.

Extensions: ``segments`` (a prompt given as its segments, the query last), ``cache_salt``
(tenant isolation: equal segments under different salts never share a cache entry) and ``mode``
(the ablation ladder; ``full`` bypasses the cache, for comparisons); and vLLM's sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``include_stop_str_in_output``, ``skip_special_tokens``).
Models are strict and forbid unknown fields, so a typo (``max_token``) or a wrong type
(``"max_tokens": "5"``) is a 400 naming the field rather than a silently ignored setting; ``null`` is
a field left out, as OpenAI reads it (``Strict``). Fields OpenAI defines that hypic does not
implement are accepted only at their neutral values.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from hypic.engine.modes import MODES
from hypic.server.chat import ROLES, check_template_kwargs, needs_content, no_content  # noqa: F401 (re-exported)


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


def _salt(value: str) -> str:
    if value == "":  # it would key entries as no salt does: another tenant's entries served
        raise ValueError("empty (leave it out for no salt)")
    if len(value) > 1024:  # said here: pydantic's length check on this type spoke of "items"
        raise ValueError(f"expected at most 1024 characters, got {len(value)}")
    return value


Salt = Annotated[Text, AfterValidator(_salt)]


def not_supported(why: str) -> Callable[[object], None]:
    """A validator for a field OpenAI defines and hypic does not serve (typed ``None``): absent or null
    only, anything else refused in words rather than pydantic's "Input should be None"."""
    def refuse(value: object) -> None:
        if value is not None:
            raise ValueError(f"not supported: {why}")
    return refuse


MAX_STOPS = 32  # stop strings a request may give (OpenAI allows 4; vLLM sets no bound)


def _at_most_max_stops(stops: list[str]) -> list[str]:
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return stops


def _stop_shape(value: object) -> str | None:
    """``stop``'s shape: a list is checked as a list only (a union would report the string member's
    error for a list too long, not the length)."""
    return "str" if isinstance(value, str) else "list[str]" if isinstance(value, list) else None


Stop = Annotated[Annotated[Text, Tag("str")]
                 | Annotated[list[Annotated[str, Field(min_length=1), AfterValidator(_utf8)]],  # []: none (vLLM's)
                             AfterValidator(_at_most_max_stops), Tag("list[str]")],
                 Discriminator(_stop_shape, custom_error_type="stop_shape",
                               custom_error_message="expected a string or a list of strings")]
INT64 = dict(ge=-(2**63), le=2**63 - 1)


class Strict(BaseModel):
    # NaN and ±Infinity (Python's json reads them) are refused as what they are, not as out of range
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI reads ``null`` in an optional field as the field left out (typed clients in Java, .NET
        and Go write every unset field so): a field with a default takes it. A field whose default is
        ``None`` reads null as ever; a required one still refuses it."""
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _defaulted(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` whose default is not None (read once per class: every message of a
    request is validated through ``Strict``)."""
    return frozenset(f.alias or name for name, f in model.model_fields.items()
                     if not f.is_required() and f.default is not None)


class Lenient(Strict):
    """A nested part of a request that clients build from other APIs' objects (a message, a content
    part, a tool call): keys hypic does not read are ignored, as vLLM ignores them — lm-eval marks
    every message ``"type": "text"``, an OpenAI SDK message dumped back into the history carries
    ``refusal`` and ``annotations``, a streamed tool call its ``index``. A request's own fields stay
    strict: a typo there (``max_token``) is named, not ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


REQUEST_ID = r"[!-~]{1,256}"  # a client's request id: visible ASCII (it goes in a header too)
EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning efforts
VERBOSITY = ("low", "medium", "high")  # OpenAI's verbosity hints


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: none is added
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


Choices = Annotated[list[Annotated[str, Field(max_length=4096)]], Field(min_length=1, max_length=1024)]
Pattern = Annotated[str, Field(max_length=16384)]
Grammar = Annotated[str, Field(max_length=65536)]  # GBNF or Lark text (hypic.engine.structured.grammar.MAX_GRAMMAR)


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: ``json`` (a schema, or its JSON text) constrains decoding as
    ``response_format`` json_schema does; ``regex`` (the whole answer matches it) and ``choice`` (the
    answer is one of the strings) and ``grammar`` (GBNF or Lark: the answer derived from its start) as
    ``SamplingParams.regex`` / ``choice`` / ``grammar``; ``structural_tag`` (its JSON text, as vLLM
    takes it, or the object) as ``SamplingParams.structural_tag``."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    choice: Choices | None = None
    regex: Pattern | None = None
    grammar: Grammar | None = None
    structural_tag: Grammar | dict[str, Any] | None = None

    @property
    def json_given(self) -> bool:
        """Whether it asks for a JSON constraint ({} and json_object false do not)."""
        return self.json_ is not None or bool(self.json_object)

    @property
    def constraint(self) -> dict[str, Any] | bool | None:
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json_, str):
            try:
                return json.loads(self.json_)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not JSON: {e}") from None
            except RecursionError:  # "[[[…" past Python's stack: the request's fault, not a 500
                raise ValueError("structured_outputs.json: nested too deep to read") from None
        return self.json_


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # absent: any JSON value
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced: what it holds is refused when not enforceable


class ResponseFormat(Strict):
    """OpenAI's ``response_format``: ``json_object`` (any JSON object) or ``json_schema`` (a value its
    schema accepts) constrain decoding (``SamplingParams.json_schema``); ``text`` does not; vLLM's
    ``structural_tag`` (``structures`` and ``triggers``, or xgrammar's ``format``) as
    ``SamplingParams.structural_tag``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[Any] | None = Field(None, max_length=1024)
    triggers: list[Any] | None = Field(None, max_length=1024)
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: given exactly when type is json_schema")
        # each refusal begins with the field it is about: the error's param (hypic.server.errors)
        given = [name for name in ("structures", "triggers", "format") if getattr(self, name) is not None]
        if self.type != "structural_tag":
            if given:
                raise ValueError(f"{given[0]}: only with type structural_tag")
        elif self.format is not None:
            if len(given) > 1:
                raise ValueError(f"{given[0]}: not with format (the older form or xgrammar's, one of them)")
        else:
            for name in ("structures", "triggers"):
                if name not in given:
                    raise ValueError(f"{name}: required with type structural_tag (or xgrammar's format)")
        return self

    @property
    def tags(self) -> dict[str, Any] | None:
        """The structural tag asked, None for another type."""
        if self.type != "structural_tag":
            return None
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        return {"type": "structural_tag", "structures": self.structures, "triggers": self.triggers}

    @property
    def constraint(self) -> dict[str, Any] | bool | None:
        if self.type == "json_object":
            return {"type": "object"}
        return None if self.json_schema is None else self.json_schema.schema_


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]  # OpenAI's limits


def _stored_never(value: object) -> object:
    if value is True:
        raise ValueError("not supported: hypic does not store chat completions (store: false or leave it out)")
    return value


def _text_only(value: object) -> object:
    if value is not None and value != ["text"]:
        raise ValueError("not supported: hypic answers in text only")
    return value


class Common(Strict):
    """Fields shared by both generation endpoints."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)  # choices (at most the server's max_choices)
    seed: int | None = Field(None, **INT64)
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # over the generated tokens
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) → bias in [-100, 100]
    # vLLM's extensions (SamplingParams has their meanings)
    top_k: int = Field(-1, ge=-1)  # 0 or −1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False  # the text ends after the stop string (or stop token) found
    # vLLM's beam search (hypic.server.beams): n is the beam width; the n best beams are the choices
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)  # a beam's score: cum_logprob / len ** length_penalty
    skip_special_tokens: bool = True  # special tokens left out of the text
    user: str | None = None  # accepted, unused
    # OpenAI's routing and accounting hints, accepted: hypic caches by content (a key adds nothing) and
    # has one tier of service
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=1024)
    service_tier: Literal["auto", "default"] | None = None
    metadata: Metadata | None = None  # accepted (OpenAI keeps it with a stored completion; hypic stores none)
    cache_salt: Salt | None = None
    mode: Literal[MODES] = "hypic"  # type: ignore[valid-type]
    response_format: ResponseFormat | None = None
    # vLLM's: the same constraint as response_format (``guided_json`` its older name)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | None = None
    guided_regex: Pattern | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    # vLLM's: words the answer never holds (SamplingParams.bad_words)
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=256)] | None \
        = None
    # vLLM's: the response's id ("cmpl-" / "chatcmpl-" + it; else the X-Request-Id header, else random)
    request_id: str | None = Field(None, pattern=f"^{REQUEST_ID}$")
    # vLLM's priority scheduling: a lower value is admitted first (hypic serve --scheduling-policy
    # priority; under the default first come, first served only 0 is taken: hypic.server.app)
    priority: int = Field(0, ge=-(2 ** 63), lt=2 ** 63)
    # vLLM's: the prompt's and the answer's token ids beside the text (what an RL rollout trains on);
    # streamed, the prompt's with a choice's first chunk and each chunk's own tokens' with it
    return_token_ids: bool | None = None
    # vLLM's: log-probabilities name every token "token_id:N" (chat's bytes are that name's)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: only the prompt's last k tokens are read (-1: as many as the context holds); a segment
    # cut in two is a new one (its tail), the segments before it are left out
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: the prompt's own log-probabilities with this many alternatives (a full forward over it),
    # in the response beside the answer (a completion's choice; a chat response's top level)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def _constraints(self) -> list[str]:
        """Where a constraint is given, each as a refusal of it names it (at most one passes
        validation)."""
        so = self.structured_outputs
        given = (("response_format.json_schema.schema",
                  self.response_format is not None and self.response_format.constraint is not None),
                 ("structured_outputs.json", so is not None and so.json_given),
                 ("structured_outputs.regex", so is not None and so.regex is not None),
                 ("structured_outputs.choice", so is not None and so.choice is not None),
                 ("structured_outputs.grammar", so is not None and so.grammar is not None),
                 ("response_format.structures", self.response_format is not None
                  and self.response_format.tags is not None),
                 ("structured_outputs.structural_tag", so is not None and so.structural_tag is not None),
                 ("guided_json", self.guided_json is not None),
                 ("guided_regex", self.guided_regex is not None),
                 ("guided_choice", self.guided_choice is not None),
                 ("guided_grammar", self.guided_grammar is not None))
        return [field for field, asked in given if asked]

    @property
    def constraint_field(self) -> str | None:
        """Where the constraint was given, None if nowhere."""
        return next(iter(self._constraints()), None)

    @property
    def constraint(self) -> dict[str, Any] | bool | None:
        """The JSON constraint asked, by whichever name (one of them at most); None for a plain-text one."""
        field = self.constraint_field
        if field == "guided_json":
            return self.guided_json
        if field == "structured_outputs.json":
            return self.structured_outputs.constraint
        if field == "response_format.json_schema.schema":
            return self.response_format.constraint
        return None

    @property
    def tag_constraint(self) -> str | dict[str, Any] | None:
        """The structural tag asked (``SamplingParams.structural_tag``), by either name."""
        if self.constraint_field == "response_format.structures":
            return self.response_format.tags
        if self.constraint_field == "structured_outputs.structural_tag":
            return self.structured_outputs.structural_tag
        return None

    @property
    def text_constraint(self) -> tuple[str | None, list[str] | None, str | None]:
        """The plain-text constraint asked (``SamplingParams.regex``, ``choice``, ``grammar``), by either name."""
        so = self.structured_outputs
        if so is not None and self.constraint_field is not None and self.constraint_field.startswith("structured_"):
            return so.regex, so.choice, so.grammar
        return self.guided_regex, self.guided_choice, self.guided_grammar

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> Common:
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's refusal too
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's refusal too
            raise ValueError("prompt_logprobs: not with stream (the prompt's scores come with the whole answer)")
        fields = self._constraints()
        named = [field.split(".")[0] for field in fields]
        if len(named) > 1 and named[0] == named[1]:  # structured_outputs' own two: named in full
            named = fields
        if len(named) > 1:
            raise ValueError(f"{named[1]}: one constraint per request ({named[0]} is given too)")
        return self

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _prompt_shape(value: object) -> str | None:
    """Which of a completions ``prompt``'s shapes a value is, by its first element (so an error names
    the element at fault within that shape, not whichever shape pydantic tried last)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        head = value[0] if value else None
        return ("list[str]" if isinstance(head, str) else "list[list[int]]" if isinstance(head, list)
                else "list[int]")
    return None


class CompletionRequest(Common):
    # text (split on <<PIC_SEP>> into segments), or token ids (one segment: the query); a list of
    # either is a batch, answered as one response (choice index = prompt index × n + choice)
    prompt: Annotated[Annotated[Text, Tag("str")] | Annotated[list[Text], Field(min_length=1), Tag("list[str]")]
                      | Annotated[TokenIds, Tag("list[int]")]
                      | Annotated[list[TokenIds], Field(min_length=1), Tag("list[list[int]]")],
                      Discriminator(_prompt_shape, custom_error_type="prompt_shape",
                                    custom_error_message="expected a string, a list of strings, token ids "
                                                         "or a list of token-id lists")] | None = None
    segments: Annotated[list[Text], Field(min_length=1)] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt ahead of the text; with logprobs, its tokens' too (a full forward)
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    suffix: Annotated[None, BeforeValidator(not_supported("hypic does not insert text before a suffix; a completion "
                                                         "only continues its prompt"))] = None
    best_of: int | None = Field(None, ge=1)  # as n, or left out: hypic returns every choice it draws

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: not supported: hypic returns every choice it draws (n); best_of may only "
                             f"equal n ({self.n})")
        return self

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt is None) == (self.segments is None):
            raise ValueError("prompt: give exactly one of prompt and segments")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is allowed only with echo (to score the prompt)")
        if self.max_tokens == 0 and self.min_tokens > 0:  # said here: the sampling check sees max_tokens 1
            raise ValueError(f"min_tokens: expected an integer in [0, max_tokens = 0], got {self.min_tokens}")
        return self

    @property
    def prompt_items(self) -> list[str | list[int]]:
        """The prompts of the request, one or a batch: each text or token ids ([] with segments)."""
        p = self.prompt
        if p is None:
            return []
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(Lenient):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class CalledFunction(Lenient):
    name: FunctionName
    arguments: Text  # JSON text, as OpenAI sends it back


class MessageToolCall(Lenient):
    id: str = Field(max_length=128)
    type: Literal["function"]
    function: CalledFunction


class Message(Lenient):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=64)] | None = None  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool's answer: to which call
    # an assistant's reasoning as the server answered it (``--reasoning-parser``; vLLM's ``reasoning``
    # too): a client sending the answer back as it came was refused; templates that read it get it
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    # OpenAI's, read by nothing here: refused when set rather than ignored (the answer would leave them out)
    function_call: Annotated[None, BeforeValidator(not_supported("the legacy function_call; send tool_calls"))] = None
    audio: Annotated[None, BeforeValidator(not_supported("hypic reads text only"))] = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and needs_content(self.role, self.tool_calls):
            raise ValueError(f"content: {no_content(self.role)}")
        return self

    @property
    def extras(self) -> dict[str, Any]:
        """What the chat template reads besides role and content (transformers' message shape)."""
        out: dict[str, Any] = {}
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            out["reasoning_content"] = thought
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @property
    def parts(self) -> list[str]:
        if isinstance(self.content, list):
            return [p.text for p in self.content]
        return [self.content or ""]


class FunctionDef(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default, true (several calls in an answer)
    # vLLM's extension: more variables for the chat template (Qwen3's enable_thinking, …)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's opening of the answer ends the prompt; or the answer continues the last
    # message (an assistant's prefilled start), not with the first
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's: to the chat template as ``reasoning_effort`` (as vLLM hands it; templates that do not
    # read it ignore it); verbosity is a hint, accepted
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    verbosity: Literal[VERBOSITY] | None = None  # type: ignore[valid-type]
    # OpenAI's: a completion kept for its evals and distillation (hypic keeps none: store false or null
    # only), and outputs hypic does not produce (null only; modalities ["text"])
    store: Annotated[bool | None, BeforeValidator(_stored_never)] = None
    modalities: Annotated[list[str] | None, BeforeValidator(_text_only)] = None
    audio: Annotated[None, BeforeValidator(not_supported("hypic answers in text only"))] = None
    prediction: Annotated[None, BeforeValidator(not_supported("hypic does not decode against a predicted "
                                                              "output"))] = None
    web_search_options: Annotated[None, BeforeValidator(not_supported("hypic searches nothing"))] = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        check_template_kwargs(self.chat_template_kwargs)
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_budget_field(self) -> str:
        """The field ``token_budget`` comes from: what a refusal of it names (the SDK sends the newer one)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class SegmentsRequest(Strict):
    """POST /v1/segments (and /evict): documents to prefill into the cache ahead of the queries that
    use them (or to forget), as texts or token ids — or as chat messages, each cached as a chat
    request's template renders it among others (its wrapper included), so that a document a chat
    sends as a message is warmed as the chat will read it."""

    model: str | None = None
    segments: Annotated[list[Text | TokenIds], Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat: a template that reads them renders differently
    cache_salt: Salt | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SegmentsRequest:
        if (self.segments is None) == (self.messages is None):
            raise ValueError("segments: send the documents as segments or as messages, one of the two")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs: only with messages")
        check_template_kwargs(self.chat_template_kwargs)
        return self
