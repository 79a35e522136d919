//! Activation offloading: a tensor kept in host memory between the forward that saved it and
//! the backward that needs it again (SMP v2's `sm_activation_offloading`).
//!
//! With activation checkpointing a recomputed layer keeps only its input, one `[batch, seq,
//! hidden]` tensor per layer, for the whole forward and most of the backward. At long sequences
//! that is what is left on the device (Llama 2 7B, 32 layers: 1 GiB at 4,096 tokens, 8 GiB at
//! 32k), so moving it to host memory lets a longer sequence fit. The values round-trip exactly,
//! so training with offloading gives bit for bit the results of training without it.
//!
//! On Burn's CUDA backend the device-to-host copy is queued on Burn's stream behind the work
//! that produces the tensor (into pinned host memory) and the host does not wait for it: the
//! copy holds the device buffer until [`HostActivation::settle`], which the caller runs a layer
//! later, when the copy is long done. The way back ([`HostActivation::reload`]) is one
//! asynchronous copy from that pinned memory into a new device buffer, queued a few layers ahead
//! of its use (SMP's `activation_loading_horizon`). Both copies run on the compute stream, in
//! order with the kernels, so they do not overlap computation; they cost about
//! `bytes / PCIe bandwidth` each (0.6 ms for a 7B layer's 32 MiB at 50-55 GB/s on an H200,
//! against about 4 ms of forward per layer at S=4096: 5 % of a 7B step with every layer
//! recomputed, measured). On other backends the tensor's data is copied into host memory at
//! once, which on a CPU backend exercises the same code path for tests.

use burn::tensor::{DType, Shape, Tensor, TensorData, backend::Backend};

#[cfg(feature = "cuda")]
use crate::cuda::{
    CudaCube,
    transfer::{BytesFuture, queue_cuda_read, queue_cuda_upload, wait_cuda_read},
};
use crate::error::SmpError;

/// A tensor's values on their way to host memory, in host memory, or (after
/// [`HostActivation::reload`]) back on the device.
pub struct HostActivation<B: Backend, const D: usize> {
    state: State,
    shape: Shape,
    dtype: DType,
    device: B::Device,
}

enum State {
    /// The CUDA copy is queued; its future holds the device buffer until it is waited for.
    #[cfg(feature = "cuda")]
    Copying(BytesFuture),
    /// The values are in (pinned) host memory, to go back to the CUDA device they came from.
    #[cfg(feature = "cuda")]
    CudaHost(cubecl::bytes::Bytes),
    /// The values are in host memory (backends other than CUDA).
    Host(TensorData),
    /// Placeholder while the state moves (never observed outside a method).
    #[cfg(feature = "cuda")]
    Moved,
}

impl<B: Backend, const D: usize> std::fmt::Debug for HostActivation<B, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            #[cfg(feature = "cuda")]
            State::Copying(..) => "copy queued",
            #[cfg(feature = "cuda")]
            State::CudaHost(..) => "in host memory",
            State::Host(_) => "in host memory",
            #[cfg(feature = "cuda")]
            State::Moved => "moved",
        };
        f.debug_struct("HostActivation")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("state", &state)
            .finish()
    }
}

/// Starts moving `t` to host memory. The device buffer is released once the copy is done and
/// [`HostActivation::settle`] (or [`HostActivation::reload`]) has run, and when the caller has
/// dropped its own handles to `t`.
///
/// # Errors
/// If CubeCL's device thread cannot be reached.
pub fn offload<B: Backend, const D: usize>(
    t: Tensor<B, D>,
) -> Result<HostActivation<B, D>, SmpError> {
    let shape = t.shape();
    let dtype = t.dtype();
    let device = t.device();
    #[cfg(feature = "cuda")]
    let state = if std::any::TypeId::of::<B>() == std::any::TypeId::of::<CudaCube>() {
        let t: Tensor<CudaCube, D> = crate::downcast::same(t);
        let prim = burn_cubecl::kernel::into_contiguous(t.into_primitive().tensor());
        let bytes = prim.meta.num_elements() * dtype.size();
        State::Copying(queue_cuda_read(prim, bytes)?)
    } else {
        State::Host(t.into_data())
    };
    #[cfg(not(feature = "cuda"))]
    let state = State::Host(t.into_data());
    Ok(HostActivation {
        state,
        shape,
        dtype,
        device,
    })
}

impl<B: Backend, const D: usize> HostActivation<B, D> {
    /// Waits for the copy to host memory (a no-op once done), which releases the device buffer.
    /// The host blocks only until the device has run up to the copy.
    ///
    /// # Errors
    /// If the device reports a failure of the copy or of the work before it.
    pub fn settle(&mut self) -> Result<(), SmpError> {
        #[cfg(feature = "cuda")]
        if let State::Copying(..) = self.state {
            let State::Copying(fut) = std::mem::replace(&mut self.state, State::Moved) else {
                unreachable!("matched above")
            };
            let bytes = wait_cuda_read(fut, "offloading an activation")?;
            if bytes.len() != self.bytes() {
                return Err(SmpError::Cuda(format!(
                    "offloading an activation of shape {:?} ({:?}): the copy returned {} bytes, \
                     expected {}",
                    self.shape.dims::<D>(),
                    self.dtype,
                    bytes.len(),
                    self.bytes()
                )));
            }
            self.state = State::CudaHost(bytes);
        }
        Ok(())
    }

    /// Whether the values are in host memory (the copy has been waited for).
    #[cfg_attr(not(feature = "cuda"), allow(unreachable_patterns))]
    pub fn is_on_host(&self) -> bool {
        match self.state {
            #[cfg(feature = "cuda")]
            State::CudaHost(..) => true,
            State::Host(_) => true,
            _ => false,
        }
    }

    /// Size of the values in bytes.
    pub fn bytes(&self) -> usize {
        self.shape.num_elements() * self.dtype.size()
    }

    /// Uploads the values to the device they came from, in their dtype.
    ///
    /// # Errors
    /// As [`HostActivation::settle`].
    #[cfg_attr(not(feature = "cuda"), allow(unreachable_patterns))]
    pub fn reload(mut self) -> Result<Tensor<B, D>, SmpError> {
        self.settle()?;
        match self.state {
            #[cfg(feature = "cuda")]
            State::CudaHost(bytes) => {
                // `CudaHost` exists only when `B` is `CudaCube`.
                let device: burn::tensor::Device<CudaCube> = crate::downcast::same(self.device);
                let prim = queue_cuda_upload(&device, bytes, self.shape, self.dtype);
                let t = Tensor::<CudaCube, D>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(prim),
                );
                Ok(crate::downcast::same(t))
            }
            State::Host(data) => Ok(Tensor::from_data(data, (&self.device, self.dtype))),
            _ => unreachable!("settle leaves the values in host memory"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;

    /// The values come back exactly, in their dtype and shape, through host memory.
    #[test]
    fn offload_and_reload_round_trip_exactly() {
        let dev = Default::default();
        let t =
            Tensor::<NdArray<f32>, 3>::from_floats([[[1.5, -2.0, 3.25], [0.1, 1e-30, -7.0]]], &dev);
        let mut host = offload(t.clone()).unwrap();
        host.settle().unwrap();
        assert!(host.is_on_host());
        assert_eq!(host.bytes(), 6 * 4);
        let back = host.reload().unwrap();
        assert_eq!(back.dims(), [1, 2, 3]);
        assert_eq!(back.dtype(), DType::F32);
        back.into_data().assert_eq(&t.into_data(), true);
    }
}
