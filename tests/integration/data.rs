//! HDF5 training images: float NCHW, uint8 NHWC and uint8 NCHW give the same tensors.

use crate::common::{fixtures, h5_tensor};
use diffmon::engine::data::{ImageSet, Layout};

#[test]
fn uint8_layouts_convert_like_the_float_file() {
    let dir = fixtures();
    let f = ImageSet::open(&dir.join("data_f32.h5"), "images").unwrap();
    let nhwc = ImageSet::open(&dir.join("data_u8_nhwc.h5"), "images").unwrap();
    let nchw = ImageSet::open(&dir.join("data_u8_nchw.h5"), "images").unwrap();
    assert_eq!(f.layout(), Layout::FloatNchw);
    assert_eq!(nhwc.layout(), Layout::U8Nhwc);
    assert_eq!(nchw.layout(), Layout::U8Nchw);
    assert_eq!(nhwc.image_shape(), f.image_shape());
    assert_eq!(nchw.image_shape(), f.image_shape());
    let expected = h5_tensor(&dir.join("data_f32.h5"), "images");
    for set in [&f, &nhwc, &nchw] {
        let all = set.read_all().unwrap();
        // x/127.5 − 1 in float32 on both sides: exact up to one rounding.
        let diff = (&all - &expected).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{:?}: {diff}", set.layout());
        // Batched reads are slices of the whole.
        let part = set.read(3, 7).unwrap();
        assert_eq!(part, all.narrow(0, 3, 4));
    }
}

#[test]
fn errors_name_file_and_dataset() {
    let dir = fixtures();
    let err = ImageSet::open(&dir.join("data_f32.h5"), "nope")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("data_f32.h5") && err.contains("no dataset `nope`") && err.contains("images"),
        "{err}"
    );
    let err = ImageSet::open(&dir.join("reference.h5"), "sigma")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("reference.h5") && err.contains("dataset `sigma`") && err.contains("[4]"),
        "{err}"
    );
    let err = ImageSet::open(&dir.join("missing.h5"), "images")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("missing.h5"), "{err}");
}
