//! JSON written the way Python's `json.dumps` writes it, which is what a chat template's
//! `tojson` produces under transformers (`json.dumps(x, ensure_ascii=False)` by default).
//!
//! serde_json differs in ways a tokenizer sees: it separates with `,` and `:` (Python with
//! `", "` and `": "`), writes `1e-7` where Python writes `1e-07` and `1e16` where Python writes
//! `1e+16`, and cannot indent with a string or emit `ensure_ascii` escapes. Key order is the
//! caller's (the values come from serde_json with `preserve_order`, like Python's dicts).

use serde_json::Value;
use std::fmt::Write;

/// `json.dumps` options a template may pass to `tojson`.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// `indent=`: `None` for one line; a string is used as is, a number as that many spaces.
    pub indent: Option<String>,
    /// `separators=(item, key)`; Python's default is `(", ", ": ")`, or `(",", ": ")` with an
    /// indent.
    pub separators: Option<(String, String)>,
    /// `ensure_ascii=`: escape every non-ASCII character as `\uXXXX` (surrogate pairs above
    /// the BMP).
    pub ensure_ascii: bool,
    /// `sort_keys=`.
    pub sort_keys: bool,
}

/// `json.dumps(value, **options)`.
pub fn dumps(value: &Value, options: &DumpOptions) -> String {
    let (item_sep, key_sep) = match &options.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    let w = Writer {
        indent: options.indent.as_deref(),
        item_sep,
        key_sep,
        ensure_ascii: options.ensure_ascii,
        sort_keys: options.sort_keys,
    };
    w.value(&mut out, value, 0);
    out
}

struct Writer<'a> {
    indent: Option<&'a str>,
    item_sep: &'a str,
    key_sep: &'a str,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Writer<'_> {
    fn value(&self, out: &mut String, v: &Value, level: usize) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    write!(out, "{i}").unwrap();
                } else if let Some(u) = n.as_u64() {
                    write!(out, "{u}").unwrap();
                } else {
                    out.push_str(&float_json(n.as_f64().unwrap_or(f64::NAN)));
                }
            }
            Value::String(s) => self.string(out, s),
            Value::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(out, i == 0, level + 1);
                    self.value(out, item, level + 1);
                }
                self.close(out, level);
                out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                out.push('{');
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.sort_keys {
                    // Python compares str by code point, as Rust's `str` ordering does.
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    self.separator(out, i == 0, level + 1);
                    self.string(out, k);
                    out.push_str(self.key_sep);
                    self.value(out, item, level + 1);
                }
                self.close(out, level);
                out.push('}');
            }
        }
    }

    /// Before an element: the item separator (not before the first) and, when indenting, a
    /// newline and the element's indentation. Python strips no trailing space from the item
    /// separator, so `separators=(", ", ": ")` with an indent leaves "," + " " + newline.
    fn separator(&self, out: &mut String, first: bool, level: usize) {
        if !first {
            out.push_str(self.item_sep);
        }
        if let Some(indent) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn close(&self, out: &mut String, level: usize) {
        if let Some(indent) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    /// Python's `encode_basestring` (or `encode_basestring_ascii` with `ensure_ascii`).
    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap(),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        write!(out, "\\u{u:04x}").unwrap();
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as `json.dumps` writes it: `repr(float)`, with `NaN`/`Infinity`/`-Infinity`.
pub fn float_json(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        float_repr(f)
    }
}

/// Python's `repr(float)` for a finite value: the shortest digits that round-trip (Rust's
/// `{:e}` finds the same ones), positional when the decimal exponent is in -5 < e < 16,
/// scientific otherwise with a sign and at least two exponent digits (`1e-07`, `1e+16`).
pub fn float_repr(f: f64) -> String {
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("{:e} writes an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-5 < exp) && (exp < 16) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn py(v: &Value) -> String {
        dumps(v, &DumpOptions::default())
    }

    // Every expected string below is what CPython 3.11's json.dumps(ensure_ascii=False) printed.
    #[test]
    fn separators_order_and_no_html_escaping() {
        let v: Value =
            serde_json::from_str(r#"{"z": 1, "a": [true, false, null], "m": {"<b>": "a & b"}}"#)
                .unwrap();
        assert_eq!(
            py(&v),
            r#"{"z": 1, "a": [true, false, null], "m": {"<b>": "a & b"}}"#
        );
        assert_eq!(py(&json!([])), "[]");
        assert_eq!(py(&json!({})), "{}");
    }

    #[test]
    fn strings_escape_like_python() {
        assert_eq!(
            py(&json!(
                "Café ☕ 日本語 🦙 \"q\" \\ \n\r\t\u{08}\u{0c}\u{01}\u{1f}\u{7f}\u{2028}"
            )),
            "\"Café ☕ 日本語 🦙 \\\"q\\\" \\\\ \\n\\r\\t\\b\\f\\u0001\\u001f\u{7f}\u{2028}\""
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        // json.dumps("é🦙") == '"\\u00e9\\ud83e\\udd99"'
        assert_eq!(dumps(&json!("é🦙"), &ascii), "\"\\u00e9\\ud83e\\udd99\"");
    }

    #[test]
    fn numbers_like_python() {
        let v: Value = serde_json::from_str(
            "[1.0, 1e-7, 1e16, 1e15, 0.0001, 0.00001, 123456789012345678, 18446744073709551615, \
             -9223372036854775808, 2.5, -0.0, 1.5e300, 0.1, 100.0, 1e22, 3.14159]",
        )
        .unwrap();
        assert_eq!(
            py(&v),
            "[1.0, 1e-07, 1e+16, 1000000000000000.0, 0.0001, 1e-05, 123456789012345678, \
             18446744073709551615, -9223372036854775808, 2.5, -0.0, 1.5e+300, 0.1, 100.0, \
             1e+22, 3.14159]"
        );
        assert_eq!(float_json(f64::NAN), "NaN");
        assert_eq!(float_json(f64::NEG_INFINITY), "-Infinity");
        assert_eq!(float_repr(1.2345678901234567e-20), "1.2345678901234567e-20");
    }

    #[test]
    fn indent_nested_like_python() {
        let v: Value =
            serde_json::from_str(r#"{"a": [1, {"b": []}, {}], "c": "ü", "d": {"e": null}}"#)
                .unwrap();
        let two = DumpOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            dumps(&v, &two),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    },\n    {}\n  ],\n  \"c\": \"ü\",\n  \"d\": {\n    \"e\": null\n  }\n}"
        );
        // indent=0: newlines, no indentation.
        let zero = DumpOptions {
            indent: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(dumps(&json!([1, 2]), &zero), "[\n1,\n2\n]");
        // json.dumps({"b": 1, "a": 2}, sort_keys=True, separators=(",", ":"))
        let compact = DumpOptions {
            separators: Some((",".into(), ":".into())),
            sort_keys: true,
            ..Default::default()
        };
        assert_eq!(
            dumps(&json!({"b": 1, "a": [2, 3]}), &compact),
            r#"{"a":[2,3],"b":1}"#
        );
    }
}
