//! [`label_enum!`]: an enum whose values are a metric's label values (and a journal's
//! strings), declared with its spelling, so that `ALL` (every value, for creating the metric's
//! series at 0) and `as_str` (the one spelling) cannot miss a variant added later.

/// Declares a `Copy` enum from `Variant => "label"` lines (each with its doc comment) and gives
/// it `ALL` (every variant, in declaration order), `as_str` (its label) and `Display` (the
/// label).
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The label value: the one spelling, which other tools read.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $label, )+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
