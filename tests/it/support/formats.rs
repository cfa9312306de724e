//! Checks on the files the exporters write, shared by the report and `compare` tests: a small
//! XML well-formedness check, a CSV line splitter and a substring count.

/// Check that `text` is well-formed XML (elements nest and close, attributes are quoted,
/// `&` starts a known entity, no stray `<`). Returns the element names in document order.
pub fn check_xml(text: &str) -> Result<Vec<String>, String> {
    let b = text.as_bytes();
    let mut i = 0;
    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut roots = 0;
    while i < b.len() {
        if b[i] == b'<' {
            if text[i..].starts_with("<?") {
                let end = text[i..].find("?>").ok_or("unclosed <?")?;
                i += end + 2;
                continue;
            }
            if text[i..].starts_with("<!--") {
                let end = text[i..].find("-->").ok_or("unclosed comment")?;
                i += end + 3;
                continue;
            }
            let end = i + text[i..].find('>').ok_or("unclosed tag")?;
            let tag = &text[i + 1..end];
            if tag.contains('<') {
                return Err(format!("'<' inside a tag at byte {i}"));
            }
            if let Some(name) = tag.strip_prefix('/') {
                let name = name.trim();
                match stack.pop() {
                    Some(open) if open == name => {}
                    other => return Err(format!("</{name}> closes {other:?} at byte {i}")),
                }
            } else {
                let self_closing = tag.ends_with('/');
                let body = tag.trim_end_matches('/');
                let name_end = body.find(|c: char| c.is_whitespace()).unwrap_or(body.len());
                let name = &body[..name_end];
                if name.is_empty() {
                    return Err(format!("empty tag name at byte {i}"));
                }
                check_attributes(&body[name_end..]).map_err(|e| format!("<{name}>: {e}"))?;
                if stack.is_empty() {
                    roots += 1;
                }
                names.push(name.to_string());
                if !self_closing {
                    stack.push(name.to_string());
                }
            }
            i = end + 1;
        } else {
            let next = text[i..].find('<').map(|n| i + n).unwrap_or(b.len());
            check_text(&text[i..next])?;
            if stack.is_empty() && !text[i..next].trim().is_empty() {
                return Err("text outside the root element".into());
            }
            i = next;
        }
    }
    if let Some(open) = stack.pop() {
        return Err(format!("<{open}> never closed"));
    }
    if roots != 1 {
        return Err(format!("{roots} root elements"));
    }
    Ok(names)
}

fn check_text(t: &str) -> Result<(), String> {
    let mut rest = t;
    while let Some(p) = rest.find('&') {
        let after = &rest[p + 1..];
        let semi = after.find(';').ok_or("bare &")?;
        let ent = &after[..semi];
        let ok = matches!(ent, "amp" | "lt" | "gt" | "quot" | "apos")
            || (ent.starts_with('#') && ent.len() > 1);
        if !ok {
            return Err(format!("unknown entity &{ent};"));
        }
        rest = &after[semi + 1..];
    }
    Ok(())
}

fn check_attributes(s: &str) -> Result<(), String> {
    let mut rest = s.trim_start();
    let mut seen = Vec::new();
    while !rest.is_empty() {
        let eq = rest
            .find('=')
            .ok_or(format!("attribute without value: {rest}"))?;
        let name = rest[..eq].trim();
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(format!("bad attribute name '{name}'"));
        }
        if seen.contains(&name) {
            return Err(format!("duplicate attribute {name}"));
        }
        seen.push(name);
        let after = rest[eq + 1..].trim_start();
        let q = after.chars().next().ok_or("missing value")?;
        if q != '"' && q != '\'' {
            return Err(format!("unquoted value of {name}"));
        }
        let close = after[1..].find(q).ok_or("unclosed value")?;
        check_text(&after[1..1 + close])?;
        rest = after[close + 2..].trim_start();
    }
    Ok(())
}

/// Split one CSV line (RFC 4180 quoting) into fields.
pub fn split_csv(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', true) => quoted = false,
            ('"', false) if cur.is_empty() => quoted = true,
            (',', false) => out.push(std::mem::take(&mut cur)),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Count occurrences of `needle` in `hay`.
pub fn count(hay: &str, needle: &str) -> usize {
    hay.matches(needle).count()
}
