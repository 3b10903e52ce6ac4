"""Write examples/prompts/conversations.jsonl: the demo's multi-turn conversations with tool calls (mode all-turns).

Each conversation is what a tool-using assistant's log looks like in the OpenAI `messages` shape: a user asks for
something a declared tool does, the assistant calls it (arguments: the tool's required parameters), the tool
result follows, the assistant answers, and the user goes on (another tool, two tools in one request, or a plain
follow-up). Deterministic: the same file every time (`python hack/make_demo_conversations.py`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "examples" / "prompts" / "conversations.jsonl"
COUNT = 48

TOOLS: dict[str, dict[str, Any]] = {
    "get_current_weather": {
        "description": "Get the current weather conditions for a location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country, e.g. 'Lyon, France'"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}},
    "convert_currency": {
        "description": "Convert an amount between two currencies at today's rate.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
            "required": ["amount", "from_currency", "to_currency"]}},
    "search_restaurants": {
        "description": "Search restaurants in a city, optionally by cuisine.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}, "cuisine": {"type": "string"}}, "required": ["location"]}},
    "get_stock_quote": {
        "description": "Latest stock quote for a ticker symbol.",
        "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}},
}
CITIES = ["Porto", "Reykjavik", "Osaka", "Lyon", "Nairobi", "Montreal", "Hobart", "Valparaiso", "Tbilisi", "Bergen"]
CUISINES = ["sushi", "vegetarian", "Georgian", "seafood", "ramen", "Ethiopian"]
CURRENCIES = [("EUR", "USD"), ("GBP", "JPY"), ("USD", "CAD"), ("CHF", "EUR"), ("AUD", "NZD")]
SYMBOLS = ["ACME", "GLOBX", "INIT", "UMBR"]


def call(name: str, arguments: dict[str, Any], turn: int, index: int = 0) -> dict[str, Any]:
    return {"id": f"call_{turn}_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def request(rng: random.Random, kind: str) -> tuple[str, str, dict[str, Any], str, str]:
    """(user text, tool, arguments, tool result, assistant answer) for one kind of request."""
    if kind == "weather":
        city = rng.choice(CITIES)
        temp = rng.randint(-5, 31)
        return (f"What's the weather like in {city} right now?", "get_current_weather", {"location": city},
                json.dumps({"location": city, "temperature_c": temp, "conditions": rng.choice(["rain", "sun", "fog"])}),
                f"It is {temp} degrees Celsius in {city} at the moment.")
    if kind == "currency":
        amount = rng.choice([40, 120, 250, 1000])
        source, target = rng.choice(CURRENCIES)
        rate = round(rng.uniform(0.5, 160), 3)
        return (f"Please convert {amount} {source} to {target}.", "convert_currency",
                {"amount": amount, "from_currency": source, "to_currency": target},
                json.dumps({"converted": round(amount * rate, 2), "rate": rate}),
                f"{amount} {source} is about {round(amount * rate, 2)} {target} at today's rate of {rate}.")
    if kind == "restaurants":
        city = rng.choice(CITIES)
        cuisine = rng.choice(CUISINES)
        return (f"Find me some {cuisine} restaurants in {city}.", "search_restaurants", {"location": city},
                json.dumps({"results": [f"{cuisine.title()} House", f"Little {city}"]}),
                f"Two options in {city}: {cuisine.title()} House and Little {city}.")
    symbol = rng.choice(SYMBOLS)
    price = round(rng.uniform(5, 900), 2)
    return (f"How is the {symbol} stock doing today?", "get_stock_quote", {"symbol": symbol},
            json.dumps({"symbol": symbol, "price": price}), f"{symbol} trades at {price} right now.")


def conversation(index: int, rng: random.Random) -> dict[str, Any]:
    kinds = ["weather", "currency", "restaurants", "stock"]
    first, second = rng.sample(kinds, 2)
    used = sorted({first, second}, key=kinds.index)
    tool_names = {"weather": "get_current_weather", "currency": "convert_currency",
                  "restaurants": "search_restaurants", "stock": "get_stock_quote"}
    declared = [tool_names[k] for k in kinds if k in used or rng.random() < 0.3]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a concise assistant with tools. Use "
                                       "them for live information."}]
    turn = 0
    ask, tool, arguments, result, answer = request(rng, first)
    messages += [{"role": "user", "content": ask},
                 {"role": "assistant", "content": "", "tool_calls": [call(tool, arguments, turn)]},
                 {"role": "tool", "tool_call_id": f"call_{turn}_0", "content": result},
                 {"role": "assistant", "content": answer}]
    turn += 2
    ask, tool, arguments, result, answer = request(rng, second)
    messages += [{"role": "user", "content": ("Thanks. " if index % 2 else "Great, and one more thing. ") + ask},
                 {"role": "assistant", "content": "", "tool_calls": [call(tool, arguments, turn)]},
                 {"role": "tool", "tool_call_id": f"call_{turn}_0", "content": result},
                 {"role": "assistant", "content": answer}]
    if index % 3 == 0:
        messages += [{"role": "user", "content": "Perfect, that's all I needed."},
                     {"role": "assistant", "content": "Glad to help. Have a good day!"}]
    elif index % 3 == 1:
        messages.append({"role": "user", "content": "Summarise both answers in one sentence."})
    return {"sample_id": f"conv-{index:04d}", "messages": messages,
            "tools": [{"type": "function", "function": {"name": name, **TOOLS[name]}} for name in declared]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rng = random.Random(12)
    rows = [conversation(index, rng) for index in range(1, COUNT + 1)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
