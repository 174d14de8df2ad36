//! Small helpers every layer uses: poison-tolerant locks, facts about
//! this host and the C allocator's policy. Imports nothing from the rest of the crate.

pub(crate) mod host;
pub(crate) mod malloc;
pub(crate) mod sync;
