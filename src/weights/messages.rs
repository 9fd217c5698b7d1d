//! How the readers' messages name things: a name taken from inside a file made safe to quote,
//! lists of names, and a mismatch between a checkpoint and the architecture.

/// A name taken from inside a file (tensor name, zip entry, pickle global, ...), made safe to
/// quote in a message: control characters escaped (`\n`, `\u{1b}`), at most 120 characters.
pub(crate) fn quote(s: &str) -> String {
    const MAX: usize = 120;
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `"<what> (<n>): <first five>[ and <n - 5> more]"` for each non-empty list, joined by `; `:
/// how a mismatch between a checkpoint and the architecture is told, here and in `model`.
pub fn mismatch_parts(lists: &[(&str, &[String])]) -> String {
    let mut parts = Vec::new();
    for (what, list) in lists {
        if !list.is_empty() {
            let shown: Vec<&str> = list.iter().take(5).map(String::as_str).collect();
            let more = if list.len() > 5 {
                format!(" and {} more", list.len() - 5)
            } else {
                String::new()
            };
            parts.push(format!(
                "{what} ({}): {}{more}",
                list.len(),
                shown.join(", ")
            ));
        }
    }
    parts.join("; ")
}

/// `a, b, c` (at most 20 names, then a count) for messages.
pub(super) fn list_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    const MAX: usize = 20;
    let names: Vec<&str> = names.into_iter().collect();
    if names.is_empty() {
        return "none".to_string();
    }
    let mut out = names
        .iter()
        .take(MAX)
        .map(|n| quote(&n.chars().take(80).collect::<String>()))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX {
        out.push_str(&format!(", … ({} more)", names.len() - MAX));
    }
    out
}
