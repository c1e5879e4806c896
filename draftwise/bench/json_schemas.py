"""The built-in `json-schema` workload: 20 prompts, each answered under its own JSON schema
(nested objects, arrays, enums, bounded numbers, required fields). Strings and arrays are bounded
(maxLength / maxItems), so every answer is a complete document within a few hundred tokens.

A prompt is a `ConstrainedPrompt`: a str (it travels through chat histories like any prompt) that
carries its schema."""
from __future__ import annotations


class ConstrainedPrompt(str):
    """A prompt with the JSON schema its answer must follow."""
    schema: dict

    def __new__(cls, text: str, schema: dict):
        obj = super().__new__(cls, text)
        obj.schema = schema
        return obj


def _s(max_len: int = 40) -> dict:
    return {"type": "string", "maxLength": max_len}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a fictional person.", _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "email": _s()})),
    ("Give a recipe for pancakes.", _obj({"title": _s(), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                                          "ingredients": {"type": "array", "items": _s(30), "maxItems": 6}})),
    ("Describe the weather in Paris today.", _obj({"city": _s(), "temperature_c": {"type": "number", "minimum": -50,
                                                                                   "maximum": 60},
                                                   "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("Summarise a book you like.", _obj({"title": _s(), "author": _s(), "year": {"type": "integer", "minimum": 1000,
                                                                                "maximum": 2030},
                                         "genres": {"type": "array", "items": _s(20), "maxItems": 3}})),
    ("Create a to-do list for a Monday.", _obj({"tasks": {"type": "array", "maxItems": 4, "items": _obj({
        "task": _s(30), "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}})}})),
    ("Describe a laptop for sale.", _obj({"brand": _s(20), "price_usd": {"type": "number", "minimum": 0,
                                                                          "maximum": 10000},
                                          "specs": _obj({"ram_gb": {"type": "integer", "minimum": 1, "maximum": 256},
                                                         "storage_gb": {"type": "integer", "minimum": 1,
                                                                        "maximum": 8192}})})),
    ("Give the address of a famous museum.", _obj({"museum": _s(), "address": _obj({
        "street": _s(), "city": _s(20), "country": _s(20)})})),
    ("Rate a movie you have seen.", _obj({"movie": _s(), "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                         "recommend": {"type": "boolean"}})),
    ("List three planets and their order from the sun.", _obj({"planets": {"type": "array", "minItems": 1,
                                                                          "maxItems": 3, "items": _obj({
        "name": _s(20), "order": {"type": "integer", "minimum": 1, "maximum": 8}})}})),
    ("Describe a pet.", _obj({"species": {"enum": ["dog", "cat", "bird", "fish"]}, "name": _s(20),
                              "age_years": {"type": "integer", "minimum": 0, "maximum": 40}})),
    ("Plan a short trip.", _obj({"destination": _s(), "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                 "activities": {"type": "array", "items": _s(30), "maxItems": 4}})),
    ("Describe a programming language.", _obj({"name": _s(20), "typed": {"enum": ["static", "dynamic"]},
                                               "first_release": {"type": "integer", "minimum": 1950,
                                                                 "maximum": 2030}})),
    ("Give a product review.", _obj({"product": _s(), "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                     "pros": {"type": "array", "items": _s(30), "maxItems": 3},
                                     "cons": {"type": "array", "items": _s(30), "maxItems": 3}})),
    ("Describe a sports team.", _obj({"team": _s(), "sport": {"enum": ["football", "basketball", "tennis",
                                                                        "hockey"]},
                                      "founded": {"type": "integer", "minimum": 1800, "maximum": 2030}})),
    ("Make a shopping list.", _obj({"items": {"type": "array", "maxItems": 5, "items": _obj({
        "name": _s(20), "quantity": {"type": "integer", "minimum": 1, "maximum": 20}})}})),
    ("Describe a job opening.", _obj({"title": _s(), "remote": {"type": "boolean"},
                                      "salary": _obj({"min": {"type": "integer", "minimum": 0, "maximum": 500000},
                                                      "max": {"type": "integer", "minimum": 0,
                                                              "maximum": 500000}})})),
    ("Give a definition of a word.", _obj({"word": _s(20), "part_of_speech": {"enum": ["noun", "verb",
                                                                                       "adjective", "adverb"]},
                                           "definition": _s(80)})),
    ("Describe a meeting.", _obj({"topic": _s(), "attendees": {"type": "array", "items": _s(20), "maxItems": 4},
                                  "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 240}})),
    ("Classify the sentiment of: 'I love this phone'.", _obj({"sentiment": {"enum": ["positive", "neutral",
                                                                                      "negative"]},
                                                              "confidence": {"type": "number", "minimum": 0,
                                                                             "maximum": 1}})),
    ("Describe a city.", _obj({"name": _s(20), "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 40000000},
                               "landmarks": {"type": "array", "items": _s(30), "maxItems": 3},
                               "location": _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}})})),
]


def load_json_schema_prompts(n: int | None = None) -> list[list[ConstrainedPrompt]]:
    """One single-turn conversation per schema; the prompt shows the schema, as a user would."""
    import json
    convs = [[ConstrainedPrompt(f"{task} Answer with a JSON object that follows this schema:\n"
                                f"{json.dumps(schema)}", schema)] for task, schema in SCHEMAS]
    return convs[:n] if n else convs
