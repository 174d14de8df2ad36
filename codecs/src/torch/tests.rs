//! Tests of the torch.save codec: round trips, shared storages, limits.

use super::*;
use crate::codec::{Codec, concat};
use crate::dtype::DType;
use crate::error::DecodeError;
use crate::limits::DecodeLimits;
use crate::tensor::{Storage, Tensor};

#[test]
fn state_dict_with_shared_storage_round_trips() {
    let w = Tensor::from_vec([2, 3], (0..6).map(|x| x as f32).collect::<Vec<_>>()).unwrap();
    let wt = w.transpose(0, 1).unwrap();
    let row = w.narrow(0, 1, 1).unwrap();
    let u = Tensor::from_vec([3], vec![1u16, 2, 3]).unwrap();
    let sd = Object::OrderedDict(vec![
        (Object::Str("w".into()), Object::Tensor(w.clone())),
        (Object::Str("wt".into()), Object::Tensor(wt.clone())),
        (Object::Str("row".into()), Object::Tensor(row.clone())),
        (Object::Str("u".into()), Object::Tensor(u.clone())),
        (Object::Str("n".into()), Object::Int(3)),
    ]);
    let file = concat(&save(&sd, &SaveOptions::default()).unwrap());
    let back = load(file.clone(), &DecodeLimits::default()).unwrap();
    let ts = back.tensors();
    assert_eq!(ts.len(), 4);
    assert!(ts[0].1.data_eq(&w));
    assert!(ts[1].1.data_eq(&wt));
    assert_eq!(ts[1].1.strides(), &[1, 3]);
    assert!(ts[2].1.data_eq(&row));
    assert_eq!(ts[2].1.storage_offset(), 3);
    assert!(ts[3].1.data_eq(&u));
    // One storage record for the three views of w.
    let entries = zip::read_entries(&file, &DecodeLimits::default()).unwrap();
    assert_eq!(entries.iter().filter(|e| e.name.contains("/data/")).count(), 2);
    // And the views share memory after loading.
    let (Storage::Host(a), Storage::Host(b)) = (ts[0].1.storage(), ts[1].1.storage()) else { panic!() };
    assert_eq!(a.as_ptr(), b.as_ptr());
}

#[test]
fn codec_round_trips_every_dtype() {
    for dtype in DType::ALL {
        let t = Tensor::new(dtype, [3, 2], (0..6 * dtype.itemsize() as u8).map(|b| b % 2).collect::<Vec<u8>>())
            .unwrap()
            .with_name("x");
        let e = TorchCodec.encode(&t).unwrap();
        let back = TorchCodec.decode(&e.info, e.to_bytes(), &DecodeLimits::default()).unwrap();
        assert!(back.data_eq(&t), "{dtype}");
        assert_eq!(back.dtype(), dtype);
        assert_eq!(back.name(), Some("x"));
    }
}

#[test]
fn limits_apply() {
    let t = Tensor::zeros(DType::Float32, [1024]).unwrap();
    let file = concat(&save(&Object::Tensor(t), &SaveOptions::default()).unwrap());
    let l = DecodeLimits { max_tensor_bytes: 100, ..Default::default() };
    assert!(matches!(load(file.clone(), &l), Err(DecodeError::TooLarge { .. })));
    // Truncated anywhere: an error, never a panic.
    for cut in (0..file.len()).step_by(7) {
        assert!(load(file.slice(..cut), &DecodeLimits::default()).is_err());
    }
}
