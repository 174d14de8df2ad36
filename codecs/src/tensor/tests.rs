//! Tests of the tensor model: construction, typed views, strided layouts.

use bytes::Bytes;

use super::*;
use crate::dtype::DType;

fn iota(shape: &[usize]) -> Tensor {
    let n = checked_numel(shape).unwrap();
    Tensor::from_vec(shape.to_vec(), (0..n as i32).collect::<Vec<_>>()).unwrap()
}

#[test]
fn size_mismatch_is_an_error() {
    let e = Tensor::new(DType::Float32, [2, 3], vec![0u8; 20]).unwrap_err();
    assert_eq!(e, TensorError::SizeMismatch { dtype: DType::Float32, shape: vec![2, 3], expected: 24, actual: 20 });
    assert!(e.to_string().contains("needs 24 bytes"));
    assert!(matches!(Tensor::zeros(DType::Float64, [usize::MAX, 2]), Err(TensorError::Overflow { .. })));
}

#[test]
fn typed_views() {
    let t = Tensor::from_slice([2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(t.as_slice::<i32>(), Err(TensorError::DTypeMismatch { .. })));
    // A view starting at an odd byte address: borrowed views refuse, to_vec copies.
    let raw = Bytes::from(vec![0u8; 17]);
    let t = Tensor::new(DType::Float32, [4], raw.slice(1..17)).unwrap();
    if !(raw.as_ptr() as usize + 1).is_multiple_of(4) {
        assert!(matches!(t.as_slice::<f32>(), Err(TensorError::Misaligned { .. })));
    }
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0; 4]);
    let h = Tensor::from_slice([2], &[half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)]).unwrap();
    assert_eq!(h.dtype(), DType::BFloat16);
    assert_eq!(h.to_vec::<half::bf16>().unwrap()[1].to_f32(), -2.0);
    let b = Tensor::from_bools([3], &[true, false, true]).unwrap();
    assert_eq!(b.to_bools().unwrap(), vec![true, false, true]);
    let bad = Tensor::new(DType::Bool, [1], vec![7u8]).unwrap();
    assert_eq!(bad.to_bools().unwrap_err(), TensorError::InvalidBool { index: 0, value: 7 });
}

#[test]
fn transpose_is_dense_and_gathers_correctly() {
    let t = iota(&[2, 3]);
    let tt = t.transpose(0, 1).unwrap();
    assert_eq!(tt.shape(), &[3, 2]);
    assert!(!tt.is_contiguous());
    assert!(tt.is_dense());
    assert_eq!(tt.to_vec::<i32>().unwrap(), vec![0, 3, 1, 4, 2, 5]);
    assert_eq!(tt.contiguous().unwrap().as_slice::<i32>().unwrap(), &[0, 3, 1, 4, 2, 5]);
}

#[test]
fn narrow_is_not_dense() {
    let t = iota(&[4, 4]);
    let n = t.narrow(1, 1, 2).unwrap();
    assert!(!n.is_dense());
    assert_eq!(n.to_vec::<i32>().unwrap(), vec![1, 2, 5, 6, 9, 10, 13, 14]);
    let r = t.narrow(0, 2, 2).unwrap();
    assert!(r.is_contiguous());
    assert_eq!(r.as_slice::<i32>().unwrap(), &[8, 9, 10, 11, 12, 13, 14, 15]);
    assert!(t.narrow(0, 3, 2).is_err());
}

#[test]
fn strided_bounds_are_checked() {
    let storage = Storage::Host(Bytes::from(vec![0u8; 16]));
    assert!(Tensor::from_strided(DType::Float32, [2, 2], [2, 1], 0, storage.clone()).is_ok());
    let e = Tensor::from_strided(DType::Float32, [2, 2], [2, 1], 1, storage.clone()).unwrap_err();
    assert_eq!(e, TensorError::OutOfBounds { needed: 20, available: 16 });
    assert!(Tensor::from_strided(DType::Float32, [2], [1, 1], 0, storage).is_err());
}

#[test]
fn crc_ignores_layout() {
    let t = iota(&[5, 7]);
    let tt = t.transpose(0, 1).unwrap();
    let c = tt.contiguous().unwrap();
    assert_eq!(tt.crc32c().unwrap(), c.crc32c().unwrap());
    assert_eq!(t.crc32c().unwrap(), crate::checksum::crc32c(t.as_bytes().unwrap()));
    assert!(tt.data_eq(&c));
    assert!(!t.data_eq(&c));
}

#[test]
fn three_d_permutation_matches_naive_gather() {
    let t = iota(&[3, 4, 5]);
    let p = t.permute(&[2, 0, 1]).unwrap();
    let v = p.to_vec::<i32>().unwrap();
    let src = t.as_slice::<i32>().unwrap();
    // Element [k][i][j] of the permuted view, for k, i, j in the ranges.
    let gather = |ks: std::ops::Range<usize>, is: std::ops::Range<usize>, js: std::ops::Range<usize>| {
        let mut out = Vec::new();
        for k in ks {
            for i in is.clone() {
                for j in js.clone() {
                    out.push(src[i * 20 + j * 5 + k]);
                }
            }
        }
        out
    };
    assert_eq!(v, gather(0..5, 0..3, 0..4));
    let s = p.narrow(0, 1, 3).unwrap().narrow(2, 1, 2).unwrap();
    let sv = s.to_vec::<i32>().unwrap();
    assert_eq!(sv, gather(1..4, 0..3, 1..3));
}

#[test]
fn shapes_of_any_rank_are_kept_whole() {
    // Up to four dimensions live inline, more on the heap: both behave alike.
    for shape in [vec![], vec![7], vec![2, 3, 4, 5], vec![2, 1, 3, 1, 2, 2], vec![1; 9]] {
        let t = iota(&shape);
        assert_eq!(t.shape(), &shape[..]);
        assert_eq!(t.strides(), &contiguous_strides(&shape)[..]);
        let c = t.clone();
        assert_eq!((c.shape(), c.strides()), (t.shape(), t.strides()));
        let b = Tensor::with_shape(DType::Int32, &shape, t.to_contiguous_bytes().unwrap()).unwrap();
        assert_eq!(b.shape(), &shape[..]);
        assert!(b.is_contiguous());
        if shape.len() >= 2 {
            let v = t.transpose(0, shape.len() - 1).unwrap();
            assert_eq!(
                v.transpose(0, shape.len() - 1).unwrap().to_contiguous_bytes().unwrap(),
                t.to_contiguous_bytes().unwrap()
            );
        }
    }
    let e = Tensor::with_shape(DType::Float32, &[2, 3], vec![0u8; 20]).unwrap_err();
    assert_eq!(e, TensorError::SizeMismatch { dtype: DType::Float32, shape: vec![2, 3], expected: 24, actual: 20 });
}

#[test]
fn row_major_strides_are_recognised_without_making_them() {
    for shape in [vec![], vec![3], vec![2, 3, 4], vec![0, 5], vec![4, 1, 1, 2, 3, 2]] {
        assert!(is_row_major(&shape, &contiguous_strides(&shape)), "{shape:?}");
    }
    assert!(!is_row_major(&[2, 3], &[1, 2]));
    assert!(!is_row_major(&[2, 3], &[3]));
    assert!(!is_row_major(&[2, 3], &[3, 1, 1]));
    assert!(!is_row_major(&[2, 3, 4, 5, 6], &[120, 20, 5, 1, 1]));
}
