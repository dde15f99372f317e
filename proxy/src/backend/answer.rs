//! An engine's answer (a whole Chat Completions answer or one stream chunk) decoded straight
//! from its bytes into the few fields the proxy reads: no `serde_json::Value` tree, so a vLLM
//! answer's ~10,000 prompt ids become one `Vec<u32>` rather than 10,000 `Value`s.
//!
//! Not `#[derive(Deserialize)]`: the decoders must accept exactly what they accepted when they
//! read a `Value`, and derived structs differ in three ways: a field of an unexpected type
//! fails the whole answer (here it reads as absent, as `Value::as_str` & co. made it), a JSON
//! array is taken for a struct (its elements as the fields in order), and a repeated key is an
//! error (a `Value` keeps the last). And skipping with `IgnoredAny` checks less than a `Value`
//! parse did (neither a string's UTF-8 nor a number's range), so an unread value is skipped
//! with [`Skip`], which parses it the way a `Value` parse does and drops it.
//!
//! Each type says what it makes of each JSON type ([`Lenient`], "absent" by default) and one
//! visitor ([`Seed`]) drives them all.
//!
//! [`decode`] first tries the fast lane ([`json_lane`]): objects and arrays walked by hand, ids
//! read by a digit loop, every other value read by serde_json in place. The lane only ever
//! gives what serde_json gives; where it cannot tell, the whole answer goes through serde_json.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::json_lane::{self, Read};

/// A type read from any JSON value: each method is one JSON type, and a type it does not
/// expect gives `Default` (absent), never an error. Containers are read through (so their
/// content is checked as JSON) and dropped.
pub(crate) trait Lenient<'de>: Default {
    fn boolean(_: bool) -> Self {
        Self::default()
    }
    fn unsigned(_: u64) -> Self {
        Self::default()
    }
    fn signed(_: i64) -> Self {
        Self::default()
    }
    fn float(_: f64) -> Self {
        Self::default()
    }
    /// A string the parser could lend from the input (no escapes in it).
    fn borrowed(s: &'de str) -> Self {
        Self::text(s)
    }
    fn text(_: &str) -> Self {
        Self::default()
    }
    fn null() -> Self {
        Self::default()
    }
    fn seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element_seed(Seed::<Skip>::NEW)?.is_some() {}
        Ok(Self::default())
    }
    fn map<A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        while map.next_key_seed(Seed::<Skip>::NEW)?.is_some() {
            map.next_value_seed(Seed::<Skip>::NEW)?;
        }
        Ok(Self::default())
    }
    /// The fast lane's reader of this type from the start of `json`, `depth` containers deep
    /// ([`json_lane`]): the value and the bytes it took, exactly as the methods above would
    /// make it; `None` (the default) to have serde_json read it.
    fn lane(_json: &'de [u8], _depth: usize) -> Read<Self> {
        None
    }
}

/// Reads a `T` from the start of `json` in the fast lane: by its own lane reader, else by
/// serde_json in place.
fn lane_value<'de, T: Lenient<'de>>(json: &'de [u8], depth: usize) -> Read<T> {
    T::lane(json, depth).or_else(|| {
        json_lane::serde_value::<SerdeRead<T>>(json, depth).map(|(SerdeRead(v), n)| (v, n))
    })
}

/// A `T` read by serde_json (through [`Seed`]), for `json_lane::serde_value`.
struct SerdeRead<T>(T);

impl<'de, T: Lenient<'de>> Deserialize<'de> for SerdeRead<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Seed::<T>::NEW.deserialize(d).map(SerdeRead)
    }
}

/// Reads a `T` from whatever JSON value comes next.
pub(crate) struct Seed<T>(PhantomData<fn() -> T>);

impl<T> Seed<T> {
    pub(crate) const NEW: Self = Seed(PhantomData);
}

impl<'de, T: Lenient<'de>> DeserializeSeed<'de> for Seed<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Lenient<'de>> Visitor<'de> for Seed<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<T, E> {
        Ok(T::boolean(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<T, E> {
        Ok(T::unsigned(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<T, E> {
        Ok(T::signed(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<T, E> {
        Ok(T::float(v))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<T, E> {
        Ok(T::borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<T, E> {
        Ok(T::text(v))
    }
    fn visit_unit<E>(self) -> Result<T, E> {
        Ok(T::null())
    }
    fn visit_none<E>(self) -> Result<T, E> {
        Ok(T::null())
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        self.deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
        T::seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::map(map)
    }
}

/// Decodes one JSON document (as `serde_json::from_slice` would: trailing whitespace only).
pub(crate) fn decode<'de, T: Lenient<'de>>(json: &'de [u8]) -> serde_json::Result<T> {
    if let Some(v) = json_lane::document(json, |json| T::lane(json, 0)) {
        return Ok(v);
    }
    decode_by_serde(json)
}

/// [`decode`] without the fast lane: the reference the lane is tested against.
pub(crate) fn decode_by_serde<'de, T: Lenient<'de>>(json: &'de [u8]) -> serde_json::Result<T> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let v = Seed::<T>::NEW.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// Reads a `T` from an already parsed value (the fuzz targets' and `/tokenize`'s way in).
pub(crate) fn from_value<'de, T: Lenient<'de>>(v: &'de Value) -> T {
    // Every `Lenient` takes every JSON type, so this cannot fail.
    Seed::<T>::NEW.deserialize(v).unwrap_or_default()
}

/// Any JSON value, parsed and dropped.
#[derive(Debug, Default)]
pub(crate) struct Skip;

impl Lenient<'_> for Skip {}

/// A JSON string (lent from the input when it has no escapes); absent for any other type.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Text<'de>(pub(crate) Option<Cow<'de, str>>);

impl<'de> Lenient<'de> for Text<'de> {
    fn borrowed(s: &'de str) -> Self {
        Text(Some(Cow::Borrowed(s)))
    }
    fn text(s: &str) -> Self {
        Text(Some(Cow::Owned(s.to_owned())))
    }
}

impl Text<'_> {
    pub(crate) fn as_str(&self) -> Option<&str> {
        self.0.as_deref()
    }

    pub(crate) fn into_string(self) -> Option<String> {
        self.0.map(Cow::into_owned)
    }
}

/// An integer that fits a `u64` (`Value::as_u64`); absent for any other value, floats included.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Int(pub(crate) Option<u64>);

impl Lenient<'_> for Int {
    fn unsigned(n: u64) -> Self {
        Int(Some(n))
    }
    fn signed(n: i64) -> Self {
        Int(u64::try_from(n).ok())
    }
}

/// Any JSON number as an `f64` (`Value::as_f64`).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Float(pub(crate) Option<f64>);

impl Lenient<'_> for Float {
    fn unsigned(n: u64) -> Self {
        Float(Some(n as f64))
    }
    fn signed(n: i64) -> Self {
        Float(Some(n as f64))
    }
    fn float(x: f64) -> Self {
        Float(Some(x))
    }
}

/// Token ids: an array of integers that fit a `u32`, decoded straight into a `Vec<u32>`.
/// `None` unless every element is one: an id past `u32::MAX` is never truncated into another
/// token's id, and a list with a hole is no list (a shorter one would misalign the rest).
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Ids(pub(crate) Option<Vec<u32>>);

impl<'de> Lenient<'de> for Ids {
    fn seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let mut ids = Vec::new();
        let mut all = true;
        // Read to the end even past a bad element: the rest must still be valid JSON.
        while let Some(Int(id)) = seq.next_element_seed(Seed::<Int>::NEW)? {
            match id.map(u32::try_from) {
                Some(Ok(id)) if all => ids.push(id),
                _ => all = false,
            }
        }
        Ok(Ids(all.then_some(ids)))
    }
    fn lane(json: &'de [u8], depth: usize) -> Read<Self> {
        json_lane::compact_ids(json, depth).map(|(ids, n)| (Ids(Some(ids)), n))
    }
}

/// A JSON array of `T`s; absent for any other type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct List<T>(pub(crate) Option<Vec<T>>);

impl<T> Default for List<T> {
    fn default() -> Self {
        List(None)
    }
}

impl<'de, T: Lenient<'de>> Lenient<'de> for List<T> {
    fn seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Seed::<T>::NEW)? {
            items.push(item);
        }
        Ok(List(Some(items)))
    }
    fn lane(json: &'de [u8], depth: usize) -> Read<Self> {
        let mut items = Vec::new();
        let n = json_lane::array(json, depth, |_, rest, depth| {
            let (item, n) = lane_value::<T>(rest, depth)?;
            items.push(item);
            Some(n)
        })?;
        Some((List(Some(items)), n))
    }
}

/// The first element of a JSON array (the rest are skipped); absent for an empty array or any
/// other type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct First<T>(pub(crate) Option<T>);

impl<T> Default for First<T> {
    fn default() -> Self {
        First(None)
    }
}

impl<'de, T: Lenient<'de>> Lenient<'de> for First<T> {
    fn seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let first = seq.next_element_seed(Seed::<T>::NEW)?;
        while seq.next_element_seed(Seed::<Skip>::NEW)?.is_some() {}
        Ok(First(first))
    }
    fn lane(json: &'de [u8], depth: usize) -> Read<Self> {
        let mut first = None;
        let n = json_lane::array(json, depth, |index, rest, depth| {
            if index == 0 {
                let (item, n) = lane_value::<T>(rest, depth)?;
                first = Some(item);
                Some(n)
            } else {
                lane_value::<Skip>(rest, depth).map(|(_, n)| n)
            }
        })?;
        Some((First(first), n))
    }
}

/// A field whose mere presence counts, whatever its value (`null` included): `Some` whenever
/// the key is there, holding what `T` makes of the value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Present<T>(pub(crate) Option<T>);

impl<T> Default for Present<T> {
    fn default() -> Self {
        Present(None)
    }
}

impl<'de, T: Lenient<'de>> Lenient<'de> for Present<T> {
    fn boolean(b: bool) -> Self {
        Present(Some(T::boolean(b)))
    }
    fn unsigned(n: u64) -> Self {
        Present(Some(T::unsigned(n)))
    }
    fn signed(n: i64) -> Self {
        Present(Some(T::signed(n)))
    }
    fn float(x: f64) -> Self {
        Present(Some(T::float(x)))
    }
    fn borrowed(s: &'de str) -> Self {
        Present(Some(T::borrowed(s)))
    }
    fn text(s: &str) -> Self {
        Present(Some(T::text(s)))
    }
    fn null() -> Self {
        Present(Some(T::null()))
    }
    fn seq<A: SeqAccess<'de>>(seq: A) -> Result<Self, A::Error> {
        T::seq(seq).map(|t| Present(Some(t)))
    }
    fn map<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        T::map(map).map(|t| Present(Some(t)))
    }
}

/// `impl Lenient` for a struct read from a JSON object: each listed key sets its field (a
/// repeated key: the last one wins, as in a `Value`), other keys are skipped, and any other
/// JSON type gives the default (all fields absent).
macro_rules! object_fields {
    ($ty:ty, $de:lifetime, { $($key:literal => $field:ident),* $(,)? }) => {
        impl<$de> Lenient<$de> for $ty {
            fn map<A: MapAccess<$de>>(mut map: A) -> Result<Self, A::Error> {
                let mut out = Self::default();
                while let Some(Text(key)) = map.next_key_seed(Seed::<Text<$de>>::NEW)? {
                    match key.as_deref() {
                        $(Some($key) => out.$field = map.next_value_seed(Seed::NEW)?,)*
                        _ => {
                            map.next_value_seed(Seed::<Skip>::NEW)?;
                        }
                    }
                }
                Ok(out)
            }
            fn lane(json: &$de [u8], depth: usize) -> Read<Self> {
                let mut out = Self::default();
                let n = json_lane::object(json, depth, |key, rest, depth| match key {
                    $($key => lane_value(rest, depth).map(|(v, n)| {
                        out.$field = v;
                        n
                    }),)*
                    _ => lane_value::<Skip>(rest, depth).map(|(_, n)| n),
                })?;
                Some((out, n))
            }
        }
    };
}

/// A whole answer or one stream chunk, as vLLM, SGLang and llama.cpp send them; each engine's
/// `TokenDialect` reads its own fields.
#[derive(Debug, Default)]
pub(crate) struct Answer<'de> {
    /// The first choice (the proxy asks for one); `None` unless `choices` is a non-empty array.
    pub(crate) choices: First<Choice<'de>>,
    pub(crate) usage: Usage,
    /// vLLM (`return_token_ids`): the prompt's ids (on the first chunk only, when streaming).
    pub(crate) prompt_token_ids: Ids,
    /// SGLang streams (`return_input_ids_in_sglext`): the prompt's ids, in a choice-less chunk.
    pub(crate) sglext: SglangExt,
    /// An error inside a stream; its presence alone (even `null`) ends the stream.
    pub(crate) error: Present<ErrorBody>,
    /// llama.cpp streams (`return_progress`): prompt processing progress, before generation.
    pub(crate) prompt_progress: PromptProgress,
}

object_fields!(Answer<'de>, 'de, {
    "choices" => choices,
    "usage" => usage,
    "prompt_token_ids" => prompt_token_ids,
    "sglext" => sglext,
    "error" => error,
    "prompt_progress" => prompt_progress,
});

/// llama.cpp's `prompt_progress`: `total` is the prompt's token count.
#[derive(Debug, Default)]
pub(crate) struct PromptProgress {
    pub(crate) total: Int,
}

object_fields!(PromptProgress, 'de, { "total" => total });

/// One choice: a whole answer's (`message`) or a stream chunk's (`delta`).
#[derive(Debug, Default)]
pub(crate) struct Choice<'de> {
    pub(crate) message: Message<'de>,
    pub(crate) delta: Message<'de>,
    pub(crate) finish_reason: Text<'de>,
    /// vLLM (`return_token_ids`): the sampled ids (the chunk's own, when streaming).
    pub(crate) token_ids: Ids,
    /// SGLang whole answers (`return_prompt_token_ids`): the prompt's ids.
    pub(crate) prompt_token_ids: Ids,
    pub(crate) logprobs: Logprobs<'de>,
    /// SGLang whole answers (`return_meta_info`).
    pub(crate) meta_info: MetaInfo,
}

object_fields!(Choice<'de>, 'de, {
    "message" => message,
    "delta" => delta,
    "finish_reason" => finish_reason,
    "token_ids" => token_ids,
    "prompt_token_ids" => prompt_token_ids,
    "logprobs" => logprobs,
    "meta_info" => meta_info,
});

/// A whole answer's `message` or a stream chunk's `delta`.
#[derive(Debug, Default)]
pub(crate) struct Message<'de> {
    pub(crate) content: Text<'de>,
    pub(crate) reasoning_content: Text<'de>,
    pub(crate) reasoning: Text<'de>,
    pub(crate) tool_calls: List<ToolCall<'de>>,
}

object_fields!(Message<'de>, 'de, {
    "content" => content,
    "reasoning_content" => reasoning_content,
    "reasoning" => reasoning,
    "tool_calls" => tool_calls,
});

#[derive(Debug, Default)]
pub(crate) struct ToolCall<'de> {
    /// Stream deltas say which call they extend.
    pub(crate) index: Int,
    pub(crate) id: Text<'de>,
    pub(crate) function: Function<'de>,
}

object_fields!(ToolCall<'de>, 'de, {
    "index" => index,
    "id" => id,
    "function" => function,
});

#[derive(Debug, Default)]
pub(crate) struct Function<'de> {
    pub(crate) name: Text<'de>,
    pub(crate) arguments: Text<'de>,
}

object_fields!(Function<'de>, 'de, {
    "name" => name,
    "arguments" => arguments,
});

/// OpenAI-style `logprobs`.
#[derive(Debug, Default)]
pub(crate) struct Logprobs<'de> {
    pub(crate) content: List<LogprobEntry<'de>>,
}

object_fields!(Logprobs<'de>, 'de, { "content" => content });

/// One `logprobs.content[]` entry (one sampled token).
#[derive(Debug, Default)]
pub(crate) struct LogprobEntry<'de> {
    pub(crate) logprob: Float,
    /// vLLM (`return_tokens_as_token_ids`) spells it `token_id:<id>`.
    pub(crate) token: Text<'de>,
    /// llama.cpp: the token's id.
    pub(crate) id: Int,
}

object_fields!(LogprobEntry<'de>, 'de, {
    "logprob" => logprob,
    "token" => token,
    "id" => id,
});

/// SGLang's `meta_info`.
#[derive(Debug, Default)]
pub(crate) struct MetaInfo {
    pub(crate) output_token_logprobs: List<SglangLogprob>,
}

object_fields!(MetaInfo, 'de, { "output_token_logprobs" => output_token_logprobs });

/// One `[logprob, token_id, text]` entry of SGLang's `output_token_logprobs`.
#[derive(Debug, Default)]
pub(crate) struct SglangLogprob {
    pub(crate) logprob: Float,
    pub(crate) id: Int,
}

impl<'de> Lenient<'de> for SglangLogprob {
    fn seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let logprob = seq
            .next_element_seed(Seed::<Float>::NEW)?
            .unwrap_or_default();
        let id = seq.next_element_seed(Seed::<Int>::NEW)?.unwrap_or_default();
        while seq.next_element_seed(Seed::<Skip>::NEW)?.is_some() {}
        Ok(SglangLogprob { logprob, id })
    }
}

/// SGLang's `sglext` (stream trailer).
#[derive(Debug, Default)]
pub(crate) struct SglangExt {
    pub(crate) input_ids: Ids,
}

object_fields!(SglangExt, 'de, { "input_ids" => input_ids });

/// The `usage` object; all counts absent when it is not an object.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: Int,
    pub(crate) completion_tokens: Int,
    pub(crate) total_tokens: Int,
    pub(crate) completion_tokens_details: CompletionTokensDetails,
}

object_fields!(Usage, 'de, {
    "prompt_tokens" => prompt_tokens,
    "completion_tokens" => completion_tokens,
    "total_tokens" => total_tokens,
    "completion_tokens_details" => completion_tokens_details,
});

/// `usage.completion_tokens_details` (vLLM with a reasoning parser counts the reasoning part).
#[derive(Debug, Default)]
pub(crate) struct CompletionTokensDetails {
    pub(crate) reasoning_tokens: Int,
}

object_fields!(CompletionTokensDetails, 'de, { "reasoning_tokens" => reasoning_tokens });

/// An `error` object in a stream chunk.
#[derive(Debug, Default)]
pub(crate) struct ErrorBody {
    pub(crate) code: Int,
}

object_fields!(ErrorBody, 'de, { "code" => code });
