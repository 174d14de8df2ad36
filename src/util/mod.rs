//! Small helpers every layer uses: poison-tolerant locks and facts about
//! this host. Imports nothing from the rest of the crate.

pub(crate) mod host;
pub(crate) mod sync;
