//! The two JSON operations header validation needs beyond `serde_json`: a parser that refuses
//! duplicate object keys (with serde_json's default, the last one silently wins, so a second
//! `__metadata__` could drop the checksums), and the canonical serialization the header
//! checksum is computed over.
//!
//! The canonical form is what Python's
//! `json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)` writes, so the
//! header checksum can be recomputed with the standard library alone
//! (docs/on-disk-format.md shows how).

use std::fmt::{self, Write};

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Parses one JSON value from `text` (surrounding JSON whitespace allowed), refusing an
/// object that has the same key twice. The error message says what is wrong and where.
pub fn parse_strict(text: &str) -> Result<Value, String> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value = Strict
        .deserialize(&mut deserializer)
        .map_err(|e| e.to_string())?;
    deserializer.end().map_err(|e| e.to_string())?;
    Ok(value)
}

/// A `DeserializeSeed` building a `serde_json::Value` that refuses duplicate keys.
#[derive(Clone, Copy)]
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "duplicate key `{key}` (a JSON object may name each key once)"
                )));
            }
            let value = map.next_value_seed(Strict)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// `value` in canonical form: object keys sorted, no whitespace, every character outside
/// printable ASCII escaped as `\uXXXX` (lowercase hex, surrogate pairs above the BMP), the
/// short escapes `\" \\ \n \r \t \b \f`, integers in decimal.
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

/// The canonical form of `object` as if its member `nested` (when an object) lacked the key
/// `skip`, without copying anything: what a checksum stored at `object[nested][skip]` covers.
pub fn canonical_without(object: &Map<String, Value>, nested: &str, skip: &str) -> String {
    let mut out = String::with_capacity(object.len() * 64);
    write_object(object, &mut out, |key, value, out| match value {
        Value::Object(inner) if key == nested => {
            write_string(key, out);
            out.push(':');
            write_object(inner, out, |key, value, out| {
                if key != skip {
                    write_member(key, value, out);
                }
            });
        }
        _ => write_member(key, value, out),
    });
    out
}

/// Writes `{...}` with the members in sorted key order, each through `member` (which may
/// write nothing); commas go between the members written.
fn write_object(
    object: &Map<String, Value>,
    out: &mut String,
    member: impl Fn(&str, &Value, &mut String),
) {
    // Rust orders `str`s by UTF-8 bytes, which is code-point order, as Python does.
    let mut keys: Vec<&String> = object.keys().collect();
    keys.sort_unstable();
    out.push('{');
    let mut first = true;
    for key in keys {
        let before = out.len();
        if !first {
            out.push(',');
        }
        let with_comma = out.len();
        member(key, &object[key], out);
        if out.len() == with_comma {
            out.truncate(before); // nothing written: no comma either
        } else {
            first = false;
        }
    }
    out.push('}');
}

fn write_member(key: &str, value: &Value, out: &mut String) {
    write_string(key, out);
    out.push(':');
    write_canonical(value, out);
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        // Headers fastckpt writes hold only integers; a float can only come from damage, and
        // any rendering of it differs from the integers the checksum was computed over.
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(object) => write_object(object, out, write_member),
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// Makes `Strict` usable where a plain `Deserialize` type is expected.
    struct StrictValue(Value);

    impl<'de> Deserialize<'de> for StrictValue {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            Strict.deserialize(deserializer).map(StrictValue)
        }
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert!(parse_strict(r#"{"a":1,"b":2}"#).is_ok());
        let top = parse_strict(r#"{"a":1,"a":2}"#).unwrap_err();
        assert!(top.contains("duplicate key `a`"), "{top}");
        let nested = parse_strict(r#"{"x":{"__metadata__":{},"__metadata__":{}}}"#).unwrap_err();
        assert!(nested.contains("duplicate key `__metadata__`"), "{nested}");
        let in_array = parse_strict(r#"[{"k":1,"k":1}]"#).unwrap_err();
        assert!(in_array.contains("duplicate key"), "{in_array}");
    }

    #[test]
    fn trailing_garbage_and_bad_json_are_refused() {
        assert!(parse_strict("{} ").is_ok());
        assert!(parse_strict("{}!").is_err());
        assert!(parse_strict("{}\0").is_err());
        assert!(parse_strict("{").is_err());
    }

    #[test]
    fn parses_what_serde_json_parses() {
        let text = r#"{"a":[1,-2,3.5,true,false,null,"s\u00e9"],"b":{}}"#;
        let strict: StrictValue = serde_json::from_str(text).unwrap();
        assert_eq!(strict.0, serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn canonical_without_skips_one_nested_key() {
        let value = parse_strict(r#"{"m":{"b":1,"skip":2,"a":3},"z":{"skip":4},"a":[]}"#).unwrap();
        let Value::Object(object) = &value else {
            unreachable!()
        };
        assert_eq!(
            canonical_without(object, "m", "skip"),
            r#"{"a":[],"m":{"a":3,"b":1},"z":{"skip":4}}"#
        );
        let only = parse_strict(r#"{"m":{"skip":1}}"#).unwrap();
        let Value::Object(only) = &only else {
            unreachable!()
        };
        assert_eq!(canonical_without(only, "m", "skip"), r#"{"m":{}}"#);
    }

    #[test]
    fn canonical_form_matches_python_json_dumps() {
        // json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True) in CPython.
        let value =
            parse_strict(r#"{"b":[1,18446744073709551615],"a":"q\"\\\n\t\u0001é😀~\u007f"}"#)
                .unwrap();
        assert_eq!(
            canonical(&value),
            r#"{"a":"q\"\\\n\t\u0001\u00e9\ud83d\ude00~\u007f","b":[1,18446744073709551615]}"#
        );
    }
}
