//! Normalizations that depend on the engine, not on the harness's API: applied to the
//! canonical request after parsing (each wire module handles its own API's quirks) and before
//! the backend call, and listed in the record.
//!
//! The one here is the system-prompt layout. Codex sends `instructions` plus several
//! `developer` items; Claude Code sends system blocks plus a `system` message after the first
//! user turn. Many chat templates take exactly one system message, first (some raise on any
//! other, some silently drop it, few know `developer`). Folding them into one leading system
//! message, the same way on every call, keeps each turn's prompt a prefix of the next.

use serde_json::Value;
use tokentap_schema::Normalization;

use crate::canonical::{ChatMessage, ChatRequest, ContentPart, Role};

/// How system-like messages (system, developer) reach the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SystemLayout {
    /// Ask the engine's template once (llama.cpp, vLLM): `single` when it rejects or drops a
    /// second system message or a `developer` one, else `as-sent`.
    #[default]
    Auto,
    /// One leading system message: every system and developer message, in order.
    Single,
    /// As the harness sent them.
    AsSent,
}

impl std::str::FromStr for SystemLayout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SystemLayout::Auto),
            "single" => Ok(SystemLayout::Single),
            "as-sent" => Ok(SystemLayout::AsSent),
            other => Err(format!(
                "unknown system layout '{other}' (auto, single, as-sent)"
            )),
        }
    }
}

/// Markers of the probe's system-like messages, which a faithful rendering shows.
const PROBE_MARKERS: [&str; 3] = [
    "tt-probe-system-1",
    "tt-probe-developer-2",
    "tt-probe-system-4",
];

/// The probe conversation for [`SystemLayout::Auto`]: a template that takes it as is can show
/// system and developer messages where harnesses put them.
pub fn layout_probe(model: &str) -> ChatRequest {
    ChatRequest {
        model: model.to_owned(),
        messages: vec![
            ChatMessage::text(Role::System, PROBE_MARKERS[0]),
            ChatMessage::text(Role::Developer, PROBE_MARKERS[1]),
            ChatMessage::text(Role::User, "tt-probe-user-3"),
            ChatMessage::text(Role::System, PROBE_MARKERS[2]),
            ChatMessage::text(Role::User, "tt-probe-user-5"),
        ],
        tools: Vec::new(),
        tool_choice: None,
        sampling: Default::default(),
        stream: false,
        extra: Default::default(),
    }
}

/// What the engine made of [`layout_probe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The rendered prompt text.
    Rendered(String),
    /// Accepted, but the engine shows no text (only a token count).
    Accepted,
    /// The template raised an error.
    Rejected(String),
    /// This engine cannot be asked.
    Unsupported,
    /// The engine could not be reached; ask again later.
    Unreachable,
}

/// Decides the layout from the engine's answer to [`layout_probe`]: an error, or a rendering
/// that lost one of the system-like messages, folds; no answer keeps messages as sent. (How a
/// `developer` message is shown is the engine's business: llama.cpp renders it as `system`.)
/// `None` means "ask again on the next call".
pub fn layout_from_probe(outcome: &ProbeOutcome) -> Option<SystemLayout> {
    match outcome {
        ProbeOutcome::Unreachable => None,
        ProbeOutcome::Unsupported | ProbeOutcome::Accepted => Some(SystemLayout::AsSent),
        ProbeOutcome::Rejected(_) => Some(SystemLayout::Single),
        ProbeOutcome::Rendered(text) => Some(if PROBE_MARKERS.iter().all(|m| text.contains(m)) {
            SystemLayout::AsSent
        } else {
            SystemLayout::Single
        }),
    }
}

/// The normalization kind of [`fold_system_messages`] (records replay it: [`crate::replay`]).
pub const SINGLE_SYSTEM_MESSAGE: &str = "single_system_message";

/// Folds every system and developer message into one leading system message (text parts
/// joined by a blank line, in order). Returns the note for the record, or `None` when the
/// request already had at most one system message, first.
pub fn fold_system_messages(request: &mut ChatRequest) -> Option<Normalization> {
    let system_like = |m: &ChatMessage| matches!(m.role, Role::System | Role::Developer);
    let positions: Vec<usize> = (0..request.messages.len())
        .filter(|&i| system_like(&request.messages[i]))
        .collect();
    let already = match positions.as_slice() {
        [] => true,
        [0] => request.messages[0].role == Role::System,
        _ => false,
    };
    if already {
        return None;
    }
    let mut parts: Vec<ContentPart> = Vec::new();
    let mut roles = Vec::new();
    let mut kept = Vec::with_capacity(request.messages.len());
    for (i, m) in std::mem::take(&mut request.messages)
        .into_iter()
        .enumerate()
    {
        if !system_like(&m) {
            kept.push(m);
            continue;
        }
        roles.push(format!("{}@{i}", m.role.as_str()));
        for p in m.content {
            match (parts.last_mut(), p) {
                (Some(ContentPart::Text { text: acc }), ContentPart::Text { text }) => {
                    acc.push_str("\n\n");
                    acc.push_str(&text);
                }
                (_, p) => parts.push(p),
            }
        }
    }
    let mut system = ChatMessage::text(Role::System, "");
    system.content = parts;
    system.content_was_string = system
        .content
        .iter()
        .all(|p| matches!(p, ContentPart::Text { .. }));
    kept.insert(0, system);
    request.messages = kept;
    Some(Normalization {
        kind: SINGLE_SYSTEM_MESSAGE.into(),
        detail: format!(
            "{} system/developer messages ({}) folded into one leading system message for the engine's chat template",
            roles.len(),
            roles.join(", ")
        ),
    })
}

/// Drops `tool_choice` when no tools are offered (engines reject it; Claude Code sends it on
/// compaction turns). Wire modules do this where their API allows it; this catches the rest.
pub fn drop_orphan_tool_choice(request: &mut ChatRequest) -> Option<Normalization> {
    if request.tools.is_empty() {
        if let Some(choice) = request.tool_choice.take() {
            let shown = match &choice {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            return Some(Normalization {
                kind: "dropped_tool_choice".into(),
                detail: format!("tool_choice {shown} dropped: the request offers no tools"),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(messages: Vec<ChatMessage>) -> ChatRequest {
        ChatRequest {
            model: "m".into(),
            messages,
            tools: Vec::new(),
            tool_choice: None,
            sampling: Default::default(),
            stream: false,
            extra: Default::default(),
        }
    }

    fn text(m: &ChatMessage) -> String {
        m.content
            .iter()
            .map(|p| match p {
                ContentPart::Text { text } => text.clone(),
                ContentPart::ImageUrl { url, .. } => format!("[{url}]"),
            })
            .collect()
    }

    #[test]
    fn codex_style_instructions_and_developer_items_fold_into_one_leading_system() {
        let mut r = request(vec![
            ChatMessage::text(Role::System, "instructions"),
            ChatMessage::text(Role::Developer, "permissions"),
            ChatMessage::text(Role::Developer, "skills"),
            ChatMessage::text(Role::User, "env"),
            ChatMessage::text(Role::User, "task"),
        ]);
        let note = fold_system_messages(&mut r).expect("folded");
        assert_eq!(note.kind, "single_system_message");
        assert!(note.detail.contains("developer@1"), "{}", note.detail);
        let roles: Vec<Role> = r.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::User]);
        assert_eq!(
            text(&r.messages[0]),
            "instructions\n\npermissions\n\nskills"
        );
    }

    #[test]
    fn a_mid_conversation_system_message_moves_up_and_the_fold_is_stable_across_turns() {
        let turn1 = vec![
            ChatMessage::text(Role::System, "agent"),
            ChatMessage::text(Role::User, "reminder"),
            ChatMessage::text(Role::System, "environment"),
        ];
        let mut r1 = request(turn1.clone());
        let mut turn2 = turn1;
        turn2.push(ChatMessage::text(Role::Assistant, "done"));
        turn2.push(ChatMessage::text(Role::User, "thanks"));
        let mut r2 = request(turn2);
        fold_system_messages(&mut r1).unwrap();
        fold_system_messages(&mut r2).unwrap();
        assert_eq!(text(&r1.messages[0]), "agent\n\nenvironment");
        assert_eq!(r2.messages[..r1.messages.len()], r1.messages[..]);
    }

    #[test]
    fn one_leading_system_or_none_is_left_alone() {
        let mut r = request(vec![
            ChatMessage::text(Role::System, "s"),
            ChatMessage::text(Role::User, "u"),
        ]);
        let before = r.clone();
        assert!(fold_system_messages(&mut r).is_none());
        assert_eq!(r, before);
        let mut r = request(vec![ChatMessage::text(Role::User, "u")]);
        assert!(fold_system_messages(&mut r).is_none());
        // A lone developer message still becomes a system message.
        let mut r = request(vec![
            ChatMessage::text(Role::Developer, "d"),
            ChatMessage::text(Role::User, "u"),
        ]);
        assert!(fold_system_messages(&mut r).is_some());
        assert_eq!(r.messages[0].role, Role::System);
    }

    #[test]
    fn images_in_system_messages_are_kept_in_order() {
        let mut with_image = ChatMessage::text(Role::Developer, "see");
        with_image.content.push(ContentPart::ImageUrl {
            url: "data:x".into(),
            detail: None,
        });
        let mut r = request(vec![
            ChatMessage::text(Role::System, "s"),
            with_image,
            ChatMessage::text(Role::User, "u"),
        ]);
        fold_system_messages(&mut r).unwrap();
        assert_eq!(text(&r.messages[0]), "s\n\nsee[data:x]");
        assert!(!r.messages[0].content_was_string);
    }

    #[test]
    fn the_probe_decides_the_layout() {
        let render = |keep: &[usize]| {
            let p = layout_probe("m");
            let text: String = keep
                .iter()
                .map(|&i| {
                    let m = &p.messages[i];
                    format!("<|im_start|>{}\n{}<|im_end|>\n", m.role.as_str(), text(m))
                })
                .collect();
            ProbeOutcome::Rendered(text)
        };
        let single = Some(SystemLayout::Single);
        assert_eq!(
            layout_from_probe(&render(&[0, 1, 2, 3, 4])),
            Some(SystemLayout::AsSent)
        );
        // A template that silently drops the later system message.
        assert_eq!(layout_from_probe(&render(&[0, 1, 2, 4])), single);
        let rejected = ProbeOutcome::Rejected("System message must be first".into());
        assert_eq!(layout_from_probe(&rejected), single);
        assert_eq!(
            layout_from_probe(&ProbeOutcome::Unsupported),
            Some(SystemLayout::AsSent)
        );
        assert_eq!(layout_from_probe(&ProbeOutcome::Unreachable), None);
        assert_eq!("single".parse(), Ok(SystemLayout::Single));
        assert!("x".parse::<SystemLayout>().is_err());
    }

    #[test]
    fn tool_choice_without_tools_is_dropped() {
        let mut r = request(vec![ChatMessage::text(Role::User, "u")]);
        r.tool_choice = Some(Value::String("auto".into()));
        let n = drop_orphan_tool_choice(&mut r).unwrap();
        assert!(n.detail.contains("auto"));
        assert!(r.tool_choice.is_none());
        assert!(drop_orphan_tool_choice(&mut r).is_none());
    }
}
