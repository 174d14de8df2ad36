//! The [`StoreService`](super::store::StoreService)'s index beside its
//! tensors: when each was stored, and the state dicts — named, ordered
//! groups of stored tensors (`m.<key>` for each key of state dict `m`).
//!
//! The store changes its tensors and this index under its own write lock,
//! taking this one second, so the two always agree.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::util::sync::lock;

#[derive(Debug, Default)]
struct Index {
    stored_at: HashMap<String, Instant>,
    member_of: HashMap<String, String>,
    state_dicts: BTreeMap<String, Vec<String>>,
}

/// See the [module docs](self).
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    index: Mutex<Index>,
}

impl Catalog {
    /// `name` was (re)stored now; it stays in the state dict it belongs to.
    pub(crate) fn stored(&self, name: &str) {
        lock(&self.index).stored_at.insert(name.to_string(), Instant::now());
    }

    /// `name` was removed: forget it, and its place in its state dict (a
    /// state dict left empty is gone).
    pub(crate) fn forget(&self, name: &str) {
        let mut ix = lock(&self.index);
        ix.stored_at.remove(name);
        if let Some(g) = ix.member_of.remove(name) {
            let empty = ix.state_dicts.get_mut(&g).is_some_and(|m| {
                m.retain(|n| n != name);
                m.is_empty()
            });
            if empty {
                ix.state_dicts.remove(&g);
            }
        }
    }

    /// State dict `group` is now exactly `names` (stored now, in this
    /// order). Names that belonged to another state dict leave it; the
    /// caller has removed the tensors of `group`'s old members.
    pub(crate) fn set_state_dict(&self, group: &str, names: &[String]) {
        let mut ix = lock(&self.index);
        if let Some(old) = ix.state_dicts.remove(group) {
            for n in old {
                ix.member_of.remove(&n);
                ix.stored_at.remove(&n);
            }
        }
        let now = Instant::now();
        for n in names {
            if let Some(other) = ix.member_of.insert(n.clone(), group.to_string())
                && other != group
                && let Some(m) = ix.state_dicts.get_mut(&other)
            {
                m.retain(|x| x != n);
                if m.is_empty() {
                    ix.state_dicts.remove(&other);
                }
            }
            ix.stored_at.insert(n.clone(), now);
        }
        ix.state_dicts.insert(group.to_string(), names.to_vec());
    }

    /// The tensor names of state dict `group`, in order.
    pub(crate) fn members(&self, group: &str) -> Option<Vec<String>> {
        lock(&self.index).state_dicts.get(group).cloned()
    }

    /// The state dict `name` belongs to, and how long ago it was stored.
    pub(crate) fn describe(&self, name: &str) -> (Option<String>, Duration) {
        let ix = lock(&self.index);
        (ix.member_of.get(name).cloned(), ix.stored_at.get(name).map_or(Duration::ZERO, Instant::elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_dicts_keep_order_and_lose_members() {
        let c = Catalog::default();
        c.set_state_dict("m", &["m.b".into(), "m.a".into()]);
        assert_eq!(c.members("m").unwrap(), vec!["m.b", "m.a"]);
        assert_eq!(c.describe("m.a").0.as_deref(), Some("m"));
        // A name taken over by another state dict leaves the first.
        c.set_state_dict("m.x", &["m.a".into()]);
        assert_eq!(c.members("m").unwrap(), vec!["m.b"]);
        c.forget("m.b");
        assert!(c.members("m").is_none());
        // Replacing a state dict drops its old members' entries.
        c.set_state_dict("m.x", &["m.x.y".into()]);
        assert_eq!(c.describe("m.a").0, None);
    }
}
