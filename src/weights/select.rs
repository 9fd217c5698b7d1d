//! Choosing the weights inside an unpickled checkpoint (`torch.save` zip or plain pickle): a
//! state dict, a pickled module tree, or diffusers' ordered `shadow_params` list. The rules are
//! those of the module docs ("Selecting the weights").

use std::path::Path;

use super::error::WeightsError;
use super::messages::list_names;
use super::pickle::{Dict, Obj, Pickle, TensorMeta, Value};
use super::types::{Naming, ReadOptions};

/// Deepest module nesting followed in a module tree.
pub(crate) const MAX_MODULE_DEPTH: usize = 256;
/// Most attributes visited while collecting a module tree's tensors (a module shared under many
/// names is visited once per name).
pub(crate) const MAX_MODULE_VISITS: usize = 1 << 22;

/// Entries that hold EMA weights, in the order they are preferred when
/// [`ReadOptions::prefer_ema`] is set.
const EMA_KEYS: &[&str] = &["ema", "ema_model", "model_ema", "ema_state_dict"];
/// Entries that hold the raw (or only) weights, in the order they are preferred. Lightning's
/// `current_model_state` (the raw weights beside averaged ones) comes first: when it is present,
/// `state_dict` holds the averaged weights.
const RAW_KEYS: &[&str] = &[
    "current_model_state",
    "state_dict",
    "model_state_dict",
    "model",
    "net",
    "module",
];

/// The selected tensors and how their names are to be matched.
pub(crate) struct Selected<'p> {
    pub(crate) tensors: Vec<(String, &'p TensorMeta)>,
    pub(crate) naming: Naming,
}

/// The attribute dict of a pickled `nn.Module` (`torch.save(model)`: a placeholder whose BUILD
/// state has `_parameters` and `_modules`), or of an EDM-style persistent object (a placeholder
/// call whose one dict argument has a `state` entry that is such an attribute dict; its
/// `module_src` is never looked at).
pub(crate) fn module_state<'p>(p: &'p Pickle, v: &Value) -> Option<&'p Dict> {
    let inst = p.instance(v)?;
    let is_module = |d: &Dict| {
        d.get_str("_parameters")
            .is_some_and(|x| p.dict(x).is_some())
            && d.get_str("_modules").is_some_and(|x| p.dict(x).is_some())
    };
    if let Some(d) = inst.state.as_ref().and_then(|s| p.dict(s))
        && is_module(d)
    {
        return Some(d);
    }
    let meta = inst.args.first().and_then(|a| p.dict(a))?;
    meta.get_str("state")
        .and_then(|s| p.dict(s))
        .filter(|d| is_module(d))
}

/// Names listed by a pickled `set` (protocol 4 opcodes, or `builtins.set([...])` at protocol 2).
fn set_names(p: &Pickle, v: &Value) -> Vec<String> {
    let items: &[Value] = match p.obj(v) {
        Some(Obj::Set(items)) | Some(Obj::List(items)) | Some(Obj::Tuple(items)) => items,
        Some(Obj::Instance(i)) if i.class.ends_with("set") => {
            match i.args.first().and_then(|a| p.obj(a)) {
                Some(Obj::List(items)) | Some(Obj::Tuple(items)) | Some(Obj::Set(items)) => items,
                _ => &[],
            }
        }
        _ => &[],
    };
    items
        .iter()
        .filter_map(|x| match x {
            Value::Str(s) => Some(s.to_string()),
            _ => None,
        })
        .collect()
}

/// Appends the tensors of the module `v` with exactly `module.state_dict()`'s names and order:
/// its non-None parameters, its non-None buffers except those named in
/// `_non_persistent_buffers_set`, then each child of `_modules` with a `name.` prefix. A module
/// already being walked (a cycle) is skipped; depth and visits are bounded. The tree is walked
/// with an explicit stack (no recursion on the file's structure), in the same order as the
/// recursive definition.
pub(crate) fn collect_module<'p>(
    p: &'p Pickle,
    v: &'p Value,
    prefix: &str,
    on_path: &mut Vec<&'p Value>,
    visits: &mut usize,
    out: &mut Vec<(String, &'p TensorMeta)>,
) -> Result<(), String> {
    /// A module being walked: its children and the next one to visit.
    struct Frame<'p> {
        prefix: String,
        children: &'p [(Value, Value)],
        next: usize,
    }
    let visit = |visits: &mut usize| {
        *visits += 1;
        if *visits > MAX_MODULE_VISITS {
            return Err(format!(
                "more than {MAX_MODULE_VISITS} module entries (modules shared under many names?)"
            ));
        }
        Ok(())
    };
    let base = on_path.len();
    // Enters the module `v`: checks the depth, appends its own tensors, returns its frame.
    let mut enter = |v: &'p Value,
                     prefix: String,
                     on_path: &mut Vec<&'p Value>,
                     visits: &mut usize|
     -> Result<Option<Frame<'p>>, String> {
        let Some(state) = module_state(p, v) else {
            return Ok(None);
        };
        if on_path.len() >= MAX_MODULE_DEPTH {
            return Err(format!(
                "modules nested deeper than {MAX_MODULE_DEPTH} levels"
            ));
        }
        on_path.push(v);
        let entries = |key: &str| {
            state
                .get_str(key)
                .and_then(|d| p.dict(d))
                .map(Dict::items)
                .unwrap_or_default()
        };
        let skipped = state
            .get_str("_non_persistent_buffers_set")
            .map(|s| set_names(p, s))
            .unwrap_or_default();
        for (key, persistent_only) in [("_parameters", false), ("_buffers", true)] {
            for (k, value) in entries(key) {
                visit(visits)?;
                let Value::Str(name) = k else { continue };
                if persistent_only && skipped.iter().any(|s| s == &**name) {
                    continue;
                }
                if let Some(t) = p.tensor(value) {
                    out.push((format!("{prefix}{name}"), t));
                }
            }
        }
        Ok(Some(Frame {
            prefix,
            children: entries("_modules"),
            next: 0,
        }))
    };
    let mut stack: Vec<Frame<'p>> = Vec::new();
    if let Some(f) = enter(v, prefix.to_string(), on_path, visits)? {
        stack.push(f);
    }
    while let Some(top) = stack.last_mut() {
        let Some((k, child)) = top.children.get(top.next) else {
            stack.pop();
            on_path.pop();
            continue;
        };
        top.next += 1;
        visit(visits)?;
        let Value::Str(name) = k else { continue };
        if module_state(p, child).is_some() && !on_path.iter().any(|o| same_obj(o, child)) {
            let prefix = format!("{}{name}.", top.prefix);
            if let Some(f) = enter(child, prefix, on_path, visits)? {
                stack.push(f);
            }
        }
    }
    on_path.truncate(base);
    Ok(())
}

pub(crate) fn same_obj(a: &Value, b: &Value) -> bool {
    matches!((a, b), (Value::Obj(x), Value::Obj(y)) if x == y)
}

pub(crate) fn key_name(p: &Pickle, k: &Value) -> String {
    match k {
        Value::Str(s) => s.to_string(),
        Value::Int(i) => i.to_string(),
        other => format!("<{}>", p.describe(other)),
    }
}

fn dict_keys(p: &Pickle, d: &Dict) -> String {
    let names: Vec<String> = d.items().iter().map(|(k, _)| key_name(p, k)).collect();
    list_names(names.iter().map(String::as_str))
}

/// Non-empty and every value a tensor.
fn is_tensor_dict(p: &Pickle, d: &Dict) -> bool {
    !d.items().is_empty() && d.items().iter().all(|(_, v)| p.tensor(v).is_some())
}

/// The items of a non-empty list whose items are all tensors (diffusers' `shadow_params`).
fn tensor_list<'p>(p: &'p Pickle, v: &Value) -> Option<Vec<&'p TensorMeta>> {
    let Some(Obj::List(items)) = p.obj(v) else {
        return None;
    };
    if items.is_empty() {
        return None;
    }
    items.iter().map(|x| p.tensor(x)).collect()
}

/// `key` in `d`, where dots may also separate nested dicts (`state.ema`): the whole key first,
/// then each split at a dot in order, depth first (an explicit stack, no recursion).
fn find_path<'p>(p: &'p Pickle, d: &'p Dict, key: &str) -> Option<&'p Value> {
    let mut stack: Vec<(&'p Dict, &str)> = vec![(d, key)];
    while let Some((d, key)) = stack.pop() {
        if let Some(v) = d.get_str(key) {
            return Some(v);
        }
        let splits: Vec<usize> = key.match_indices('.').map(|(i, _)| i).collect();
        for &i in splits.iter().rev() {
            if let Some(sub) = d.get_str(&key[..i]).and_then(|v| p.dict(v)) {
                stack.push((sub, &key[i + 1..]));
            }
        }
    }
    None
}

/// The tensors of a module tree, or an error message.
fn module_tensors<'p>(
    p: &'p Pickle,
    v: &'p Value,
) -> Result<Vec<(String, &'p TensorMeta)>, String> {
    let mut out = Vec::new();
    collect_module(p, v, "", &mut Vec::new(), &mut 0, &mut out)?;
    Ok(out)
}

fn dict_tensors<'p>(p: &'p Pickle, d: &'p Dict) -> Vec<(String, &'p TensorMeta)> {
    d.items()
        .iter()
        .filter_map(|(k, v)| p.tensor(v).map(|t| (key_name(p, k), t)))
        .collect()
}

fn ordered<'p>(key: &str, list: Vec<&'p TensorMeta>) -> Selected<'p> {
    Selected {
        tensors: list
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("{key}.{i}"), t))
            .collect(),
        naming: Naming::Ordered,
    }
}

/// The weights chosen by `opts` (see the module docs), in order. `bad` turns a malformed
/// module tree into the caller's error.
pub(crate) fn select<'p>(
    p: &'p Pickle,
    opts: &ReadOptions,
    path: &Path,
    bad: &dyn Fn(String) -> WeightsError,
) -> Result<Selected<'p>, WeightsError> {
    let by_name = |tensors| Selected {
        tensors,
        naming: Naming::ByName,
    };
    if module_state(p, &p.root).is_some() {
        return Ok(by_name(module_tensors(p, &p.root).map_err(bad)?));
    }
    let Some(root) = p.dict(&p.root) else {
        return Err(WeightsError::NotAStateDict {
            path: path.to_path_buf(),
            what: format!("the checkpoint holds {}", p.describe(&p.root)),
        });
    };
    if let Some(key) = opts.weights_key.as_deref() {
        let Some(v) = find_path(p, root, key) else {
            return Err(WeightsError::NoStateDict {
                path: path.to_path_buf(),
                key: key.to_string(),
                keys: dict_keys(p, root),
            });
        };
        if module_state(p, v).is_some() {
            return Ok(by_name(module_tensors(p, v).map_err(bad)?));
        }
        if let Some(list) = tensor_list(p, v) {
            return Ok(ordered(key, list));
        }
        let Some(d) = p.dict(v) else {
            return Err(WeightsError::NotAStateDict {
                path: path.to_path_buf(),
                what: format!("entry `{key}` holds {}", p.describe(v)),
            });
        };
        if !d.items().is_empty() && !d.items().iter().any(|(_, v)| p.tensor(v).is_some()) {
            return Err(WeightsError::NotAStateDict {
                path: path.to_path_buf(),
                what: format!(
                    "entry `{key}` is a dict without tensors (keys: {})",
                    dict_keys(p, d)
                ),
            });
        }
        return Ok(by_name(dict_tensors(p, d)));
    }
    if root.items().iter().all(|(_, v)| p.tensor(v).is_some()) {
        return Ok(by_name(dict_tensors(p, root)));
    }
    // Candidates: entries holding a non-empty state dict or a module tree with tensors.
    let mut candidates: Vec<(String, Vec<(String, &'p TensorMeta)>)> = Vec::new();
    for (k, v) in root.items() {
        if let Some(d) = p.dict(v).filter(|d| is_tensor_dict(p, d)) {
            candidates.push((key_name(p, k), dict_tensors(p, d)));
        } else if module_state(p, v).is_some() {
            let tensors = module_tensors(p, v).map_err(bad)?;
            if !tensors.is_empty() {
                candidates.push((key_name(p, k), tensors));
            }
        }
    }
    let has = |k: &str| candidates.iter().position(|(n, _)| n == k);
    let pick = if candidates.len() == 1 {
        Some(0)
    } else if candidates.is_empty() {
        None
    } else {
        let mut pick = None;
        if opts.prefer_ema {
            // Lightning's weight averaging: `state_dict` holds the averaged weights.
            if has("current_model_state").is_some() {
                pick = has("state_dict");
            }
            pick = pick.or_else(|| EMA_KEYS.iter().find_map(|k| has(k)));
        }
        pick.or_else(|| RAW_KEYS.iter().find_map(|k| has(k)))
    };
    if let Some(i) = pick {
        return Ok(by_name(candidates.swap_remove(i).1));
    }
    if candidates.is_empty() {
        if let Some(list) = root
            .get_str("shadow_params")
            .and_then(|v| tensor_list(p, v))
        {
            return Ok(ordered("shadow_params", list));
        }
        return Err(WeightsError::AmbiguousStateDict {
            path: path.to_path_buf(),
            reason: "no entry is a dict of tensors or a module".to_string(),
            keys: dict_keys(p, root),
        });
    }
    let names: Vec<&str> = candidates.iter().map(|(n, _)| n.as_str()).collect();
    Err(WeightsError::AmbiguousStateDict {
        path: path.to_path_buf(),
        reason: format!("several entries hold weights ({})", list_names(names)),
        keys: dict_keys(p, root),
    })
}
