//! Where tensors live: [`Device`], its parse error [`UnknownDevice`], and
//! the [`DeviceBuffer`] trait the `tensorwire` crate implements for GPU memory.

use std::fmt;
use std::str::FromStr;

/// Where a tensor's elements live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// GPU memory of CUDA device N.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A device string that is neither `cpu` nor `cuda[:N]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
pub struct UnknownDevice(pub String);

impl FromStr for Device {
    type Err = UnknownDevice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t == "cpu" {
            return Ok(Device::Cpu);
        }
        if t == "cuda" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = t.strip_prefix("cuda:")
            && let Ok(n) = n.parse()
        {
            return Ok(Device::Cuda(n));
        }
        Err(UnknownDevice(s.to_string()))
    }
}

/// Memory on an accelerator, implemented by the `tensorwire` crate's `cuda`
/// feature. The codecs never touch device memory: they ask for host bytes,
/// and the pipeline stages device tensors through pinned host buffers.
pub trait DeviceBuffer: Send + Sync + fmt::Debug + 'static {
    /// The device holding the buffer.
    fn device(&self) -> Device;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `offset` into host memory.
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
    /// For downcasting to the concrete buffer type.
    fn as_any(&self) -> &dyn std::any::Any;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!("tpu".parse::<Device>().is_err());
    }
}
