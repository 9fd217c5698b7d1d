//! Where things are in a config file's text, found by plain scans (the YAML parser reports
//! neither of them): the line and column of a key, for error messages that name it, and where
//! flow collections nest too deep, refused before libyaml's scanner (quadratic in depth) sees
//! the text.

/// Deepest flow nesting (`[`/`{`) accepted. A real config nests 3 deep; the YAML scanner's cost
/// grows with the square of the depth (100 KB of `[` took 12 s), so deeper input is refused
/// before it is parsed.
pub const MAX_FLOW_DEPTH: usize = 32;

/// Where (line, column, from 1) flow collections first nest deeper than [`MAX_FLOW_DEPTH`], by a
/// linear scan that skips comments and quoted scalars; `None` when they never do.
pub(super) fn too_deep(text: &str) -> Option<(usize, usize)> {
    let (mut depth, mut line, mut column) = (0usize, 1, 0);
    let (mut quote, mut comment, mut escaped) = (None::<char>, false, false);
    let mut prev = '\n';
    for c in text.chars() {
        column += 1;
        match (quote, c) {
            (_, '\n') => {
                comment = false;
                line += 1;
                column = 0;
            }
            _ if comment => {}
            (Some('"'), '\\') => escaped = !escaped,
            (Some(q), _) => {
                if c == q && !escaped {
                    quote = None;
                }
                escaped = false;
            }
            (None, '#') if prev.is_whitespace() => comment = true,
            // A quote opens a scalar only where one may start (`don't` is plain text).
            (None, '\'' | '"') if prev.is_whitespace() || "[{,:".contains(prev) => quote = Some(c),
            (None, '[' | '{') => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some((line, column));
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        prev = c;
    }
    None
}

/// Where the key at `path` (`icr.samples`, `alerts.webhooks[0].url`; empty for the top level)
/// is written in `text`, as (line, column) counted from 1; with `extra = Some((name, n))`, the
/// `n`-th occurrence of `name:` inside that key instead. A plain scan, for error messages: each
/// segment is looked for from where its parent was found on, outside comments, in block or flow
/// style.
pub(super) fn key_position(
    text: &str,
    path: &str,
    extra: Option<(&str, usize)>,
) -> Option<(usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let find = |name: &str, nth: usize, from: (usize, usize)| -> Option<(usize, usize)> {
        // A key such as `.[` gives a path with an empty name, which is nowhere (and would match
        // at every column without moving on).
        if name.is_empty() {
            return None;
        }
        let mut seen = 0;
        for (i, line) in lines.iter().enumerate().skip(from.0) {
            let code = line.split(" #").next().unwrap_or(line);
            if code.trim_start().starts_with('#') {
                continue;
            }
            let start = if i == from.0 { from.1 } else { 0 };
            let mut search = start;
            while let Some(off) = code.get(search..).and_then(|c| c.find(name)) {
                let col = search + off;
                let before = code[..col].chars().last();
                let after = code[col + name.len()..].trim_start();
                if before.is_none_or(|c| c.is_whitespace() || c == '{' || c == ',' || c == '-')
                    && after.starts_with(':')
                {
                    seen += 1;
                    if seen == nth {
                        return Some((i, col));
                    }
                }
                search = col + name.len();
            }
        }
        None
    };
    // The start of the last key found, and where the next one is looked for.
    let mut at = (0, 0);
    let mut from = (0, 0);
    for segment in path.split('.').filter(|s| !s.is_empty()) {
        let name = segment.split('[').next().unwrap_or(segment);
        at = find(name, 1, from)?;
        from = (at.0, at.1 + name.len());
    }
    if let Some((name, nth)) = extra {
        at = find(name, nth, from)?;
    }
    Some((at.0 + 1, at.1 + 1))
}
