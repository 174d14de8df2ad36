//! Facts about this host that the handshake carries.

/// Identifies this host for same-host detection: the kernel's boot id.
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Devices this process can put tensors on.
pub(crate) fn devices() -> Vec<String> {
    #[allow(unused_mut)]
    let mut d = vec!["cpu".to_string()];
    #[cfg(feature = "cuda")]
    d.extend(crate::cuda::device_names());
    d
}
