"""OpenAI's Conversations API (/v1/conversations) and the Responses API's ``conversation``: a conversation is a
stored list of items that responses made in it read as their earlier input and add their own input and output
items to.

Contracts:
- a conversation is a record of the response store (`response_store`: kept, dropped least recently used, saved
  and journalled with the stored responses): ``{"id": "conv_...", "parent": None, "conversation": {id, object,
  created_at, metadata}, "items": [...]}``; `is_conversation` tells it from a response's record. Items are kept
  as a stored response's input items are (`openai_responses.stored_input`'s form: each with its id and status).
- POST /v1/conversations takes at most `MAX_NEW_ITEMS` items, POST .../items as many; metadata is at most 16
  string pairs (keys up to 64 characters, values up to 512), as the API has it.
- a response with ``conversation`` reads the conversation's items before its own input (not with
  ``previous_response_id``) and, when it ends, adds its input and then its output items (`turn_items`), before its
  last event or its body goes out, so the client's next turn reads them. Adds to one conversation are ordered
  on a replica (the caller's lock); two replicas adding to one conversation at once may lose one's items.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import TypeAdapter

from decapybara.api import responses_schemas as rs
from decapybara.api.common import new_id
from decapybara.api.errors import ApiError, bad_request
from decapybara.api.openai_responses import items_page as page
from decapybara.api.openai_responses import stored_items

MAX_NEW_ITEMS = 20
_ITEMS = TypeAdapter(list[rs.ItemIn])


def is_conversation(record: dict[str, Any] | None) -> bool:
    return record is not None and "conversation" in record


def checked_items(items: Any, limit: int | None, param: str = "items") -> list[dict[str, Any]]:
    """Input items (as /v1/responses takes them) in their stored form: each with its id (the one it came with,
    else a new one) and a status."""
    if not isinstance(items, list) or (limit is not None and len(items) > limit):
        raise bad_request(f"{param} must be a list of at most {limit} items" if limit else
                          f"{param} must be a list of items", param)
    try:
        parsed = _ITEMS.validate_python(items)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    for i, item in enumerate(parsed):
        if isinstance(item, rs.OtherItemIn):
            raise bad_request(f"{param}.{i}: items of type {item.type!r} are not supported (messages, function_call, "
                              "function_call_output and reasoning are)", f"{param}.{i}.type")
    return stored_items(parsed)


def new_record(items: list[dict[str, Any]], metadata: dict[str, str]) -> dict[str, Any]:
    cid = new_id("conv_")
    head = {"id": cid, "object": "conversation", "created_at": int(time.time()), "metadata": metadata}
    return {"id": cid, "parent": None, "conversation": head, "items": items}


def deleted(cid: str) -> dict[str, Any]:
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


def items_page(record: dict[str, Any], order: str, limit: str, after: str | None) -> dict[str, Any]:
    """GET .../items: the conversation's items as `openai_responses.items_page` pages them."""
    return page(record["items"], order, limit, after, "this conversation")


def added(items: list[dict[str, Any]]) -> dict[str, Any]:
    """POST .../items' answer: the items added, as a list."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


def add_items(record: dict[str, Any], items: list[dict[str, Any]]) -> None:
    """`items` added to the conversation's; an id it already holds, or one twice among them, a 400 (ids stay
    unique, so paging by ``after`` ends)."""
    seen = {i.get("id") for i in record["items"]}
    for item in items:
        if item["id"] in seen:
            raise bad_request(f"Duplicate item found with id {item['id']!r}", "items")
        seen.add(item["id"])
    record["items"] += items


def item(record: dict[str, Any], item_id: str) -> dict[str, Any]:
    """The conversation's item `item_id` (a 404 where it has none)."""
    found = next((i for i in record["items"] if i.get("id") == item_id), None)
    if found is None:
        raise ApiError(404, f"no item {item_id!r} in conversation {record['id']!r}", param="item_id", code="not_found")
    return found


def delete_item(record: dict[str, Any], item_id: str) -> None:
    """The conversation's item `item_id` taken out (a 404 where it has none)."""
    record["items"].remove(item(record, item_id))


def conversation_id(value: Any) -> str:
    """The Responses API's ``conversation``: an id, or ``{"id": ...}``."""
    cid = value.get("id") if isinstance(value, dict) else value
    if not isinstance(cid, str) or not cid:
        raise bad_request('conversation must be a conversation id or {"id": ...}', "conversation")
    return cid


def turn_items(response_record: dict[str, Any]) -> list[dict[str, Any]]:
    """What a response made in a conversation adds to it: its input items, then its output items."""
    return [*response_record["input"], *response_record["response"]["output"]]
