"""The string and number types every request model uses (openai_protocol.py, chat_fields.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256  # model, user and message names
INT64_MAX = 2**63 - 1


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string is not valid Unicode (it holds a lone surrogate)") from None
    return s


# A JSON string that is valid Unicode; every request string is one.
Text = Annotated[str, AfterValidator(_valid_unicode)]
Name = Annotated[Text, StringConstraints(max_length=MAX_NAME_CHARS)]
StopString = Annotated[Text, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
